//! A small client for the RabbitMQ management HTTP API: what AMQP cannot tell —
//! queue listings, stored arguments, policies, bindings and feature flags.
//!
//! Invariant: credentials from the URL go into the Authorization header only and
//! never into messages or logs. An `https://` URL is verified like `amqps://` (system
//! roots plus `broker.tls.ca_file`, see [`crate::tls`]); there is no way to skip it.

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::redact::Secret;
use crate::tls::TlsFiles;

#[derive(Debug, thiserror::Error)]
pub enum ManagementError {
    #[error("management API request to {path} failed: {message}")]
    Request { path: String, message: String },
    #[error("management API answered {status} for {path}")]
    Status { path: String, status: u16 },
}

#[derive(Clone)]
pub struct Management {
    base: url::Url,
    user: String,
    password: String,
    http: reqwest::Client,
}

#[derive(Debug, Deserialize)]
pub struct QueueInfo {
    pub name: String,
    #[serde(default)]
    pub arguments: Map<String, Value>,
    #[serde(default)]
    pub policy: Option<String>,
    #[serde(default)]
    pub operator_policy: Option<String>,
    #[serde(default)]
    pub effective_policy_definition: Option<Value>,
    #[serde(default)]
    pub messages: Option<u64>,
    #[serde(default)]
    pub messages_ready: Option<u64>,
    #[serde(default)]
    pub messages_unacknowledged: Option<u64>,
    #[serde(default)]
    pub consumers: Option<u64>,
    /// Bytes the queue process uses (sampled by the management plugin).
    #[serde(default)]
    pub memory: Option<u64>,
    /// Quorum queues: the nodes holding a replica, those online, and the leader.
    /// Read leniently: while a member is away the API may show other shapes here,
    /// which must not make the whole queue unreadable.
    #[serde(default, deserialize_with = "names")]
    pub members: Option<Vec<String>>,
    #[serde(default, deserialize_with = "names")]
    pub online: Option<Vec<String>>,
    #[serde(default, deserialize_with = "name")]
    pub leader: Option<String>,
    /// Counters of what went through the queue (sampled by the management plugin).
    #[serde(default)]
    pub message_stats: Option<MessageStats>,
}

/// A queue's message counters since it was declared.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct MessageStats {
    /// Messages that entered the queue (published or dead-lettered into it).
    #[serde(default)]
    pub publish: Option<u64>,
    /// Messages delivered to consumers or fetched.
    #[serde(default)]
    pub deliver_get: Option<u64>,
}

fn names<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::Array(items) => Some(
            items
                .into_iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect(),
        ),
        _ => None,
    })
}

fn name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::String(s) if !s.is_empty() => Some(s),
        _ => None,
    })
}

#[derive(Debug, Deserialize)]
pub struct NodeInfo {
    pub name: String,
    #[serde(default)]
    pub running: bool,
}

#[derive(Debug, Deserialize)]
pub struct FeatureFlag {
    pub name: String,
    pub state: String,
}

#[derive(Debug, Deserialize)]
pub struct ConnectionInfo {
    pub name: String,
    #[serde(default)]
    pub client_properties: Map<String, Value>,
    /// The cluster node the connection is on.
    #[serde(default)]
    pub node: Option<String>,
}

impl ConnectionInfo {
    /// The name the client gave itself (lapse: `lapse worker <prefix>`, ...).
    pub fn client_name(&self) -> Option<&str> {
        self.client_properties.get("connection_name")?.as_str()
    }
}

#[derive(Debug, Deserialize)]
pub struct BindingInfo {
    pub routing_key: String,
}

impl ManagementError {
    /// Why the API could not be used at all, when that is the case: the request never
    /// got an answer (connection refused, TLS, timeout) or the credentials were refused
    /// (401, or 403 for a user without the management tag). One such reason makes every
    /// further request fail the same way, so callers say it once instead of per check.
    pub fn unreachable_reason(&self) -> Option<String> {
        match self {
            ManagementError::Request { message, .. } => {
                let lower = message.to_ascii_lowercase();
                if lower.contains("decod") {
                    return None; // an answer came, it was not what lapse expects
                }
                let why = if lower.contains("connection refused") {
                    "connection refused".to_string()
                } else if lower.contains("certificate") || lower.contains("tls") {
                    message.clone()
                } else if lower.contains("timed out") || lower.contains("timeout") {
                    format!("no answer within the timeout ({message})")
                } else {
                    message.clone()
                };
                Some(why)
            }
            ManagementError::Status { status: 401, .. } => Some(
                "401 Unauthorized: the user or password in broker.management_url is refused"
                    .to_string(),
            ),
            ManagementError::Status { status: 403, .. } => Some(
                "403 Forbidden: the user of broker.management_url lacks the management tag"
                    .to_string(),
            ),
            ManagementError::Status { .. } => None,
        }
    }
}

impl Management {
    /// The API's base URL without credentials, for messages.
    pub fn shown_url(&self) -> String {
        self.base.to_string()
    }

    /// A client for `url`; `https://` is verified against the system roots.
    pub fn new(url: &Secret) -> Result<Self, ManagementError> {
        Self::with_tls(url, &TlsFiles::default())
    }

    /// A client for `url` that trusts (and presents) what `tls` holds.
    pub fn with_tls(url: &Secret, tls: &TlsFiles) -> Result<Self, ManagementError> {
        let mut base = url::Url::parse(url.expose()).map_err(|e| ManagementError::Request {
            path: "(base URL)".into(),
            message: e.to_string(),
        })?;
        let user = match base.username() {
            "" => "guest".to_string(),
            u => percent_decode(u),
        };
        let password = percent_decode(base.password().unwrap_or("guest"));
        let _ = base.set_username("");
        let _ = base.set_password(None);
        let client_error = |message: String| ManagementError::Request {
            path: "(client)".into(),
            message,
        };
        let http = tls
            .http_client()
            .map_err(|e| client_error(e.to_string()))?
            .timeout(std::time::Duration::from_secs(10))
            .build()
            .map_err(|e| ManagementError::Request {
                path: "(client)".into(),
                message: e.to_string(),
            })?;
        Ok(Self {
            base,
            user,
            password,
            http,
        })
    }

    fn url(&self, segments: &[&str]) -> Result<url::Url, ManagementError> {
        let mut url = self.base.clone();
        {
            let mut path = url
                .path_segments_mut()
                .map_err(|_| ManagementError::Request {
                    path: self.base.to_string(),
                    message: "base URL cannot have a path".into(),
                })?;
            path.pop_if_empty().push("api");
            for s in segments {
                path.push(s);
            }
        }
        Ok(url)
    }

    /// Sends an authenticated request; returns the response and the path shown in errors.
    async fn send(
        &self,
        method: reqwest::Method,
        segments: &[&str],
    ) -> Result<(reqwest::Response, String), ManagementError> {
        let url = self.url(segments)?;
        let shown = url.path().to_string();
        let mut request = self
            .http
            .request(method.clone(), url)
            .basic_auth(&self.user, Some(&self.password));
        if method == reqwest::Method::DELETE {
            request = request.header("X-Reason", "closed by lapse");
        }
        let response = request.send().await.map_err(|e| ManagementError::Request {
            path: shown.clone(),
            message: describe(e),
        })?;
        Ok((response, shown))
    }

    async fn get<T: for<'de> Deserialize<'de>>(
        &self,
        segments: &[&str],
    ) -> Result<Option<T>, ManagementError> {
        let (response, shown) = self.send(reqwest::Method::GET, segments).await?;
        match response.status().as_u16() {
            404 => Ok(None),
            200..=299 => response
                .json()
                .await
                .map(Some)
                .map_err(|e| ManagementError::Request {
                    path: shown,
                    message: e.without_url().to_string(),
                }),
            status => Err(ManagementError::Status {
                path: shown,
                status,
            }),
        }
    }

    pub async fn queue(
        &self,
        vhost: &str,
        name: &str,
    ) -> Result<Option<QueueInfo>, ManagementError> {
        self.get(&["queues", vhost, name]).await
    }

    pub async fn queues(&self, vhost: &str) -> Result<Vec<QueueInfo>, ManagementError> {
        Ok(self.get(&["queues", vhost]).await?.unwrap_or_default())
    }

    pub async fn connections(&self) -> Result<Vec<ConnectionInfo>, ManagementError> {
        Ok(self.get(&["connections"]).await?.unwrap_or_default())
    }

    /// Force-closes a connection (by the broker's connection name).
    pub async fn close_connection(&self, name: &str) -> Result<(), ManagementError> {
        let (response, shown) = self
            .send(reqwest::Method::DELETE, &["connections", name])
            .await?;
        match response.status().as_u16() {
            200..=299 | 404 => Ok(()),
            status => Err(ManagementError::Status {
                path: shown,
                status,
            }),
        }
    }

    /// Every node of the cluster, running or not.
    pub async fn nodes(&self) -> Result<Vec<NodeInfo>, ManagementError> {
        Ok(self.get(&["nodes"]).await?.unwrap_or_default())
    }

    pub async fn feature_flags(&self) -> Result<Vec<FeatureFlag>, ManagementError> {
        Ok(self.get(&["feature-flags"]).await?.unwrap_or_default())
    }

    pub async fn bindings(
        &self,
        vhost: &str,
        exchange: &str,
        queue: &str,
    ) -> Result<Vec<BindingInfo>, ManagementError> {
        Ok(self
            .get(&["bindings", vhost, "e", exchange, "q", queue])
            .await?
            .unwrap_or_default())
    }
}

/// The error and its causes (reqwest's own text hides the TLS reason), without the URL.
fn describe(e: reqwest::Error) -> String {
    let e = e.without_url();
    if crate::tls::is_certificate_error(&e) {
        return format!(
            "TLS certificate verification failed ({}); if the broker's certificate is signed \
             by a private CA, set broker.tls.ca_file",
            chain(&e)
        );
    }
    chain(&e)
}

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}
