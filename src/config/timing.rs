//! Intervals, timeouts and the AMQP heartbeat: the settings where zero (or less than
//! the unit the other side understands) would make a loop spin or switch a protection
//! off. Each is refused with an error naming its key.

use std::time::Duration;

use super::{BrokerConfig, Config, ConfigError, Secret};

/// The longest `worker.lock_retry` accepted (a locked row is looked at again at least
/// this often).
pub const MAX_LOCK_RETRY: Duration = Duration::from_secs(10 * 60);

/// The longest `worker.batch_window` and `worker.release_batch_window` accepted.
pub const MAX_BATCH_WINDOW: Duration = Duration::from_secs(10);

impl Config {
    /// Intervals and timeouts where zero would make a loop spin or switch a
    /// protection off.
    pub(super) fn validate_intervals(&self) -> Result<(), ConfigError> {
        let ms = Duration::from_millis(1);
        // PostgreSQL takes these in milliseconds as a 32-bit integer.
        let pg_max = Duration::from_millis(i32::MAX.unsigned_abs().into());
        within("relay.poll_interval", self.relay.poll_interval, ms, None)?;
        within("sweeper.interval", self.sweeper.interval, ms, None)?;
        // The lease is renewed once per batch: shorter than a second it would lapse
        // between batches on a busy database; a day keeps a frozen leader leading.
        within(
            "sweeper.lease",
            self.sweeper.lease,
            Duration::from_secs(1),
            Some(Duration::from_secs(86_400)),
        )?;
        // Half of it is the longest a delivery is kept unacknowledged; under a second
        // that would leave no room for a hold. RabbitMQ checks it about once a minute.
        within(
            "broker.consumer_timeout",
            self.broker.consumer_timeout,
            Duration::from_secs(2),
            Some(Duration::from_millis(crate::tier::MAX_TTL_MS)),
        )?;
        // A locked order's delivery is held this long at a time; past the hold limit
        // (half the broker's consumer timeout) it is replaced by a fresh copy.
        let lock_retry_max = (self.broker.hold_limit() / 2).min(MAX_LOCK_RETRY);
        if self.worker.lock_retry > lock_retry_max {
            return Err(ConfigError::new(
                "worker.lock_retry",
                format!(
                    "must be at most {} (10 min, and a quarter of broker.consumer_timeout: a \
                     delivery is kept unacknowledged at most half of it, so a locked row is \
                     looked at twice before its delivery is renewed)",
                    humantime::format_duration(lock_retry_max)
                ),
            ));
        }
        within("worker.lock_retry", self.worker.lock_retry, ms, None)?;
        // Rate-limited, a full prefetch waits in the client's buffer before it is even
        // read: that wait counts towards the broker's consumer timeout too.
        if self.worker.closes_per_second > 0 {
            let drain = Duration::from_secs_f64(
                f64::from(self.worker.prefetch) / f64::from(self.worker.closes_per_second),
            );
            if drain > self.broker.hold_limit() / 2 {
                return Err(ConfigError::new(
                    "worker.prefetch",
                    format!(
                        "is {} at worker.closes_per_second = {}: the last of a full prefetch \
                         waits {} to be read, more than a quarter of broker.consumer_timeout; \
                         lower the prefetch",
                        self.worker.prefetch,
                        self.worker.closes_per_second,
                        humantime::format_duration(Duration::from_secs(drain.as_secs()))
                    ),
                ));
            }
        }
        within("worker.stall_limit", self.worker.stall_limit, ms, None)?;
        // A batch's first delivery waits unacknowledged for the whole window: past
        // seconds it would only add lateness (or hold stock) and near the broker's
        // consumer_timeout it would cost the channel. Zero takes what is there.
        let window_max = Some(MAX_BATCH_WINDOW);
        within(
            "worker.batch_window",
            self.worker.batch_window,
            Duration::ZERO,
            window_max,
        )?;
        within(
            "worker.release_batch_window",
            self.worker.release_batch_window,
            Duration::ZERO,
            window_max,
        )?;
        // Shorter than a second, every shutdown would be abandoned (exit 1).
        let second = Duration::from_secs(1);
        within(
            "worker.drain_timeout",
            self.worker.drain_timeout,
            second,
            None,
        )?;
        within(
            "database.statement_timeout",
            self.database.statement_timeout,
            ms,
            Some(pg_max),
        )?;
        within(
            "database.lock_timeout",
            self.database.lock_timeout,
            ms,
            Some(pg_max),
        )?;
        within(
            "broker.heartbeat",
            self.broker.heartbeat,
            Duration::from_secs(1),
            Some(Duration::from_secs(u16::MAX.into())),
        )?;
        self.broker.validate_url_heartbeat()
    }
}

impl BrokerConfig {
    /// The longest the worker keeps a delivery unacknowledged: half the broker's
    /// consumer timeout, leaving the other half for the batch that decides it.
    pub fn hold_limit(&self) -> Duration {
        self.consumer_timeout / 2
    }

    /// Why the other half of the consumer timeout may not cover the work of a batch
    /// (`None` when it does): a batch's database calls, publishes and acknowledgement
    /// are each bounded by a timeout, and their sum should fit in it.
    pub fn consumer_timeout_margin_short(
        &self,
        statement_timeout: Duration,
        ack_timeout: Duration,
    ) -> Option<String> {
        let work = statement_timeout + self.confirm_timeout + ack_timeout;
        (self.consumer_timeout - self.hold_limit() < work).then(|| {
            format!(
                "broker.consumer_timeout is {}: half of it is shorter than one batch may take \
                 at worst ({} = database.statement_timeout + broker.confirm_timeout + the \
                 acknowledgement's bound); a batch that slow makes the broker close the \
                 channel, and its deliveries return with their delivery count raised",
                humantime::format_duration(self.consumer_timeout),
                humantime::format_duration(work)
            )
        })
    }

    /// A `heartbeat` in the URL wins over `broker.heartbeat`, so it is held to the same
    /// rule: `heartbeat=0` would switch off the bound on a frozen worker.
    fn validate_url_heartbeat(&self) -> Result<(), ConfigError> {
        use std::str::FromStr;
        for address in super::split_addresses(&self.url) {
            let Ok(uri) = lapin::uri::AMQPUri::from_str(address.expose()) else {
                continue; // reported as an invalid URL by the caller's URL check
            };
            if uri.query.heartbeat == Some(0) {
                return Err(ConfigError::new(
                    "broker.url",
                    "heartbeat=0 in the URL switches heartbeats off (a frozen worker would keep \
                     its deliveries until its TCP connection dies); remove it or set at least 1",
                ));
            }
        }
        Ok(())
    }

    /// `url` with `broker.heartbeat` as its `heartbeat` query parameter, unless the URL
    /// names one itself; each address on its own when it names several. Used by the
    /// worker's connections.
    pub fn url_with_heartbeat(&self) -> Secret {
        let all: Vec<Secret> = super::split_addresses(&self.url)
            .into_iter()
            .map(|address| {
                let Ok(mut url) = url::Url::parse(address.expose()) else {
                    return address;
                };
                if url.query_pairs().any(|(key, _)| key == "heartbeat") {
                    return address;
                }
                url.query_pairs_mut()
                    .append_pair("heartbeat", &self.heartbeat.as_secs().to_string());
                Secret::new(String::from(url))
            })
            .collect();
        super::join_addresses(&all)
    }
}

/// `value` at least `min` (and at most `max`, when given).
fn within(
    key: &str,
    value: Duration,
    min: Duration,
    max: Option<Duration>,
) -> Result<(), ConfigError> {
    if value < min {
        return Err(ConfigError::new(
            key,
            format!(
                "must be at least {} (zero would spin or switch the protection off)",
                humantime::format_duration(min)
            ),
        ));
    }
    if let Some(max) = max.filter(|max| value > *max) {
        return Err(ConfigError::new(
            key,
            format!("must be at most {}", humantime::format_duration(max)),
        ));
    }
    Ok(())
}
