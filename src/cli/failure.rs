//! What a command's error means for the operator: the exit status and a message that
//! says what to do next (run `lapse migrate`, check which URL key, enable the
//! management plugin), without the doubled prefixes of a raw error chain.

use lapin::ErrorKind;

use super::ExitStatus;
use crate::amqp::broker::BrokerError;
use crate::amqp::management::ManagementError;
use crate::config::ConfigError;
use crate::db::InShard;
use crate::redact::redact;
use crate::runtime::backoff::SessionError;

/// The exit status and the one-line message (credentials already masked).
#[derive(Debug, PartialEq, Eq)]
pub struct Failure {
    pub status: ExitStatus,
    pub message: String,
}

impl Failure {
    fn new(status: ExitStatus, message: String) -> Self {
        Self {
            status,
            message: redact(&message).into_owned(),
        }
    }
}

/// Reads `error`'s chain for a cause lapse knows how to explain; any other error is
/// exit status 1 with its chain, each cause once.
pub fn explain(error: &anyhow::Error) -> Failure {
    for cause in error.chain() {
        if let Some(f) = known(cause) {
            return f;
        }
    }
    Failure::new(ExitStatus::Failed, chain_text(error.chain()))
}

/// True when `error` (or a cause of it) is refused credentials, a missing database or
/// another mistake only a configuration change heals (exit 2), not a service that
/// did not answer.
pub fn is_usage(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(cause) = next {
        if let Some(f) = known(cause) {
            return f.status == ExitStatus::Usage;
        }
        next = cause.source();
    }
    false
}

fn known(cause: &(dyn std::error::Error + 'static)) -> Option<Failure> {
    if let Some(e) = cause.downcast_ref::<InShard>() {
        return Some(in_shard(e));
    }
    if let Some(e) = cause.downcast_ref::<ConfigError>() {
        return Some(Failure::new(ExitStatus::Usage, e.to_string()));
    }
    if let Some(e) = cause.downcast_ref::<crate::tls::TlsError>() {
        return Some(Failure::new(
            ExitStatus::Usage,
            format!("invalid configuration: broker.tls: {e}"),
        ));
    }
    if let Some(e) = cause.downcast_ref::<tokio_postgres::Error>() {
        return database(e);
    }
    if let Some(e @ crate::db::DbError::NoAnswer { .. }) =
        cause.downcast_ref::<crate::db::DbError>()
    {
        return Some(unreachable_database(&e.to_string()));
    }
    if let Some(e) = cause.downcast_ref::<crate::db::DbError>()
        && e.is_reordered_list()
    {
        return Some(Failure::new(
            ExitStatus::Usage,
            format!("invalid configuration: database.url: {e}"),
        ));
    }
    if let Some(deadpool_postgres::PoolError::Timeout(_)) =
        cause.downcast_ref::<deadpool_postgres::PoolError>()
    {
        return Some(unreachable_database("no connection within the timeout"));
    }
    if let Some(e) = cause.downcast_ref::<BrokerError>() {
        return broker(e);
    }
    if let Some(e) = cause.downcast_ref::<ManagementError>() {
        return Some(management(e));
    }
    None
}

/// An error of one shard: what its cause means, naming `database.shards[i]` where the
/// explanation names `database.url`; a cause lapse has no explanation for (a failed
/// migration, say) is shown with the key in front.
fn in_shard(e: &InShard) -> Failure {
    let mut next = std::error::Error::source(e);
    while let Some(cause) = next {
        if let Some(f) = known(cause) {
            let message = f
                .message
                .replace(" (or LAPSE_DATABASE__URL)", "")
                .replace("database.url", &e.key);
            return Failure {
                status: f.status,
                message: match message.contains(&e.key) {
                    true => message,
                    false => format!("{}: {message}", e.key),
                },
            };
        }
        next = cause.source();
    }
    let chain = std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |c| {
        c.source()
    });
    Failure::new(ExitStatus::Failed, chain_text(chain))
}

/// A PostgreSQL error: refused login, missing database or schema, or no answer.
pub fn database(e: &tokio_postgres::Error) -> Option<Failure> {
    let usage = |m: String| Some(Failure::new(ExitStatus::Usage, m));
    if let Some(db) = e.as_db_error() {
        let message = db.message();
        return match db.code().code() {
            "3D000" => usage(format!(
                "the database named in database.url does not exist ({message}); \
                 run `lapse migrate` to create it and its schema"
            )),
            "28P01" | "28000" => usage(format!(
                "the database refused the login of database.url ({message}); check the user \
                 and password in database.url (or LAPSE_DATABASE__URL)"
            )),
            "42P01" | "42883" => usage(format!(
                "the database of database.url has no lapse schema, or an old one ({message}); \
                 run `lapse migrate`"
            )),
            // Connection exceptions and a server starting up or shutting down.
            code if code.starts_with("08") || code.starts_with("57P") => {
                Some(unreachable_database(message))
            }
            _ => None,
        };
    }
    if crate::tls::is_certificate_error(e) {
        let cause = std::error::Error::source(e).map_or_else(|| e.to_string(), |s| s.to_string());
        return usage(format!(
            "database.url: the database server's certificate was rejected ({cause}); with \
             sslmode=verify-ca or verify-full it must chain to the system's roots or to \
             sslrootcert, and with verify-full name the host in database.url"
        ));
    }
    if e.to_string().starts_with("error performing TLS handshake")
        && !e.to_string().contains("server does not support TLS")
    {
        let cause = std::error::Error::source(e).map_or_else(|| e.to_string(), |s| s.to_string());
        return usage(format!(
            "database.url: the TLS handshake with the database server failed ({cause}); check \
             sslmode and the server's TLS settings"
        ));
    }
    if e.to_string().contains("server does not support TLS") {
        return usage(format!(
            "database.url asks for TLS (sslmode), but the database server does not offer it ({e})"
        ));
    }
    if e.is_closed()
        || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
        || e.to_string().contains("timeout")
    {
        let cause = std::error::Error::source(e).map_or_else(|| e.to_string(), |s| s.to_string());
        return Some(unreachable_database(&cause));
    }
    None
}

fn unreachable_database(cause: &str) -> Failure {
    Failure::new(
        ExitStatus::Unreachable,
        format!(
            "cannot reach the database of database.url ({cause}); is PostgreSQL running, \
             and are the host and port in database.url right?"
        ),
    )
}

fn broker(e: &BrokerError) -> Option<Failure> {
    let BrokerError::Connect(inner) = e else {
        return match e {
            BrokerError::CertificateRejected { .. } => {
                Some(Failure::new(ExitStatus::Usage, e.to_string()))
            }
            BrokerError::ConnectTimeout { .. } => Some(Failure::new(
                ExitStatus::Unreachable,
                format!("cannot reach the broker of broker.url: {e}"),
            )),
            // Connected, then silent: as good as unreachable for a command.
            BrokerError::ReplyTimeout { .. } | BrokerError::AckTimeout { .. } => {
                Some(Failure::new(
                    ExitStatus::Unreachable,
                    format!("the broker of broker.url stopped answering: {e}"),
                ))
            }
            _ => None,
        };
    };
    if e.is_fatal() {
        return Some(Failure::new(
            ExitStatus::Usage,
            format!(
                "the broker refused the login of broker.url ({}); check the user, password \
                 and virtual host in broker.url (or LAPSE_BROKER__URL)",
                lapin_text(inner)
            ),
        ));
    }
    let cause = match inner.kind() {
        ErrorKind::IOError(io) => io.to_string(),
        _ => lapin_text(inner),
    };
    Some(Failure::new(
        ExitStatus::Unreachable,
        format!(
            "cannot reach the broker of broker.url ({cause}); is RabbitMQ running, and are \
             the host and port in broker.url right?"
        ),
    ))
}

/// lapin's text without its repeated `protocol error: AMQP soft error:` layers.
fn lapin_text(e: &lapin::Error) -> String {
    match e.kind() {
        ErrorKind::ProtocolError(p) => p.get_message().to_string(),
        _ => e.to_string(),
    }
}

fn management(e: &ManagementError) -> Failure {
    match e {
        ManagementError::Request { message, .. } => Failure::new(
            ExitStatus::Unreachable,
            format!(
                "the management API of broker.management_url did not answer ({message}); \
                 enable the plugin (`rabbitmq-plugins enable rabbitmq_management`) or correct \
                 broker.management_url, or unset it to check only what AMQP can"
            ),
        ),
        ManagementError::Status { status: 401, .. } => Failure::new(
            ExitStatus::Usage,
            "the management API refused the login of broker.management_url; check its user \
             and password (the user needs the `monitoring` or `management` tag)"
                .to_string(),
        ),
        ManagementError::Status { .. } => Failure::new(ExitStatus::Failed, e.to_string()),
    }
}

/// The chain's messages joined by `: `, leaving out a cause whose text the message
/// before it already contains (wrappers that print their source).
pub fn chain_text<'a>(
    chain: impl Iterator<Item = &'a (dyn std::error::Error + 'static)>,
) -> String {
    let mut text = String::new();
    for cause in chain {
        let message = cause.to_string();
        if message.is_empty() || text.contains(&message) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&message);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Outer(#[source] Inner);

    #[derive(Debug, thiserror::Error)]
    #[error("inner")]
    struct Inner(#[source] std::io::Error);

    #[test]
    fn a_cause_already_printed_by_its_wrapper_is_not_repeated() {
        let error = anyhow::Error::new(Outer(Inner(std::io::Error::other("refused"))));
        assert_eq!(chain_text(error.chain()), "outer: inner: refused");
        let f = explain(&error);
        assert_eq!(f.status, ExitStatus::Failed);
        assert_eq!(f.message, "outer: inner: refused");
    }

    #[test]
    fn a_configuration_error_is_usage_wherever_it_sits_in_the_chain() {
        let error = anyhow::Error::new(ConfigError {
            key: "broker.prefix".into(),
            problem: "must not be empty".into(),
        })
        .context("starting");
        let f = explain(&error);
        assert_eq!(f.status, ExitStatus::Usage);
        assert!(f.message.contains("broker.prefix"), "{}", f.message);
    }

    /// A shard's error names its key: an explained cause with `database.shards[i]` in
    /// place of `database.url`, any other cause (a failed migration, say) with the key
    /// in front.
    #[test]
    fn an_error_of_one_shard_names_its_key() {
        use crate::db::DbError;
        let timeout = deadpool_postgres::PoolError::Timeout(deadpool_postgres::TimeoutType::Wait);
        let error = anyhow::Error::new(InShard::new(2, DbError::Pool(timeout)));
        let f = explain(&error);
        assert_eq!(f.status, ExitStatus::Unreachable);
        assert!(f.message.contains("database.shards[2]"), "{}", f.message);
        assert!(!f.message.contains("database.url"), "{}", f.message);

        let error = anyhow::Error::new(InShard::new(
            1,
            DbError::Unreadable("lapse_settings: no row".into()),
        ))
        .context("starting");
        let f = explain(&error);
        assert_eq!(f.status, ExitStatus::Failed);
        assert!(
            f.message
                .contains("database.shards[1]: unreadable value: lapse_settings"),
            "{}",
            f.message
        );
    }

    #[test]
    fn a_broker_that_stopped_answering_is_unreachable() {
        let error = anyhow::Error::new(BrokerError::ReplyTimeout {
            op: "queue.declare",
            after: std::time::Duration::from_secs(15),
        })
        .context("lapse status");
        let f = explain(&error);
        assert_eq!(f.status, ExitStatus::Unreachable);
        assert!(
            f.message.contains("stopped answering") && f.message.contains("queue.declare"),
            "{}",
            f.message
        );
    }

    #[test]
    fn an_unanswered_management_api_says_to_enable_the_plugin() {
        let error = anyhow::Error::new(ManagementError::Request {
            path: "/api/overview".into(),
            message: "connection refused".into(),
        });
        let f = explain(&error);
        assert_eq!(f.status, ExitStatus::Unreachable);
        assert!(f.message.contains("rabbitmq_management"), "{}", f.message);
    }
}
