//! `topology verify`: compare the live broker with the tier file.
//!
//! Over AMQP alone it finds missing objects and argument drift (a passive declare
//! says whether an object exists; a full redeclare on a fresh channel makes the
//! broker compare arguments and answer 406 on drift, without creating anything since
//! the object exists). Through the management API it also checks the stored
//! arguments exactly, bindings, overriding policies and the feature flags that
//! at-least-once dead-lettering needs. What it could not check is reported as
//! skipped, never as passed. A management API that cannot be used at all (refused,
//! TLS, 401) is reported once, with the reason, instead of failing every check.

use serde::Serialize;
use serde_json::Value;

use super::apply::{Declared, declare_exchange, declare_queue};
use super::{ArgValue, GROUP_SIZE_ARG, LEADER_LOCATOR_ARG, QueueRole, QueueSpec, Topology};
use crate::amqp::broker::BrokerError;
use crate::amqp::management::{Management, QueueInfo};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckStatus {
    Ok,
    Failed,
    Skipped,
}

#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub subject: String,
    pub check: String,
    pub status: CheckStatus,
    pub detail: String,
}

#[derive(Debug, Default, Serialize)]
pub struct VerifyReport {
    pub checks: Vec<Check>,
    /// Why the management API could not be used (refused, TLS, 401), said once; its
    /// checks were not made. `lapse topology verify` exits 3 then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub management_unreachable: Option<String>,
}

impl VerifyReport {
    /// True when nothing checked failed (skipped checks are listed, not failed).
    pub fn ok(&self) -> bool {
        self.checks.iter().all(|c| c.status != CheckStatus::Failed)
    }

    fn push(&mut self, subject: &str, check: &str, status: CheckStatus, detail: impl Into<String>) {
        self.checks.push(Check {
            subject: subject.to_string(),
            check: check.to_string(),
            status,
            detail: detail.into(),
        });
    }

    pub fn render_table(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            let status = match c.status {
                CheckStatus::Ok => "ok",
                CheckStatus::Failed => "FAILED",
                CheckStatus::Skipped => "skipped",
            };
            out.push_str(&format!(
                "{:<8} {:<40} {:<14} {}\n",
                status, c.subject, c.check, c.detail
            ));
        }
        let failed = self
            .checks
            .iter()
            .filter(|c| c.status == CheckStatus::Failed)
            .count();
        let skipped = self
            .checks
            .iter()
            .filter(|c| c.status == CheckStatus::Skipped)
            .count();
        out.push_str(&format!(
            "{} checks: {} failed, {} skipped\n",
            self.checks.len(),
            failed,
            skipped
        ));
        out
    }
}

/// Policy keys that would override the arguments lapse relies on.
const GUARDED_POLICY_KEYS: &[&str] = &[
    "message-ttl",
    "dead-letter-exchange",
    "dead-letter-routing-key",
    "dead-letter-strategy",
    "overflow",
    "delivery-limit",
    "max-length",
    "max-length-bytes",
    "expires",
    "queue-mode",
];

pub async fn verify(
    conn: &lapin::Connection,
    management: Option<&Management>,
    vhost: &str,
    topology: &Topology,
) -> Result<VerifyReport, BrokerError> {
    let mut report = VerifyReport::default();
    for e in &topology.exchanges {
        let outcome = match declare_exchange(conn, e, true).await? {
            Declared::Ok => declare_exchange(conn, e, false).await?,
            other => other,
        };
        record(&mut report, &e.name, outcome);
    }
    for q in &topology.queues {
        let outcome = match declare_queue(conn, q, true).await? {
            Declared::Ok => declare_queue(conn, q, false).await?,
            other => other,
        };
        record(&mut report, &q.name, outcome);
    }
    match management {
        Some(m) => verify_with_management(&mut report, m, vhost, topology).await,
        None => {
            for check in ["feature flags", "policies", "bindings", "exact arguments"] {
                report.push(
                    "(broker)",
                    check,
                    CheckStatus::Skipped,
                    "needs broker.management_url (the management HTTP API)",
                );
            }
        }
    }
    Ok(report)
}

fn record(report: &mut VerifyReport, name: &str, outcome: Declared) {
    match outcome {
        Declared::Ok => report.push(name, "declared", CheckStatus::Ok, "exists, arguments match"),
        Declared::Missing => report.push(name, "declared", CheckStatus::Failed, "missing"),
        Declared::Drift(d) => report.push(
            name,
            "arguments",
            CheckStatus::Failed,
            format!(
                "{} is {} on the broker, the tier file wants {}",
                d.argument, d.actual, d.expected
            ),
        ),
    }
}

/// The checks only the management API can make: feature flags, exact queue
/// arguments, overriding policies, bindings.
async fn verify_with_management(
    report: &mut VerifyReport,
    m: &Management,
    vhost: &str,
    topology: &Topology,
) {
    if !check_feature_flags(report, m).await {
        return;
    }
    for q in &topology.queues {
        let info = match queue_info(m, vhost, &q.name).await {
            Ok(Some(info)) => info,
            Ok(None) => continue, // already reported missing over AMQP
            Err(e) => {
                report.push(&q.name, "management", CheckStatus::Failed, e.to_string());
                continue;
            }
        };
        replicas(report, &q.name, &info, topology.group_size);
        check_queue(report, q, &info);
    }
    check_bindings(report, m, vhost, topology).await;
}

/// The feature flags at-least-once dead-lettering needs; false when the management
/// API cannot be reached (then no other check of it is made).
async fn check_feature_flags(report: &mut VerifyReport, m: &Management) -> bool {
    match m.feature_flags().await {
        Err(e) if e.unreachable_reason().is_some() => {
            let why = e.unreachable_reason().unwrap_or_default();
            let hint = if why.contains("refused") {
                "; enable the plugin (`rabbitmq-plugins enable rabbitmq_management`) or \
                 correct broker.management_url"
            } else {
                ""
            };
            let detail = format!(
                "cannot reach the management API at {}: {why}; its checks were not made{hint}",
                m.shown_url()
            );
            report.push(
                "(management API)",
                "reachable",
                CheckStatus::Failed,
                &detail,
            );
            report.management_unreachable = Some(detail);
            return false;
        }
        Ok(flags) => {
            for wanted in ["quorum_queue", "stream_queue"] {
                let state = flags
                    .iter()
                    .find(|f| f.name == wanted)
                    .map(|f| f.state.as_str());
                let (status, detail) = match state {
                    Some("enabled") => (CheckStatus::Ok, "enabled".to_string()),
                    Some(s) => (
                        CheckStatus::Failed,
                        format!(
                            "{s}: at-least-once dead-lettering silently falls back to at-most-once"
                        ),
                    ),
                    None => (CheckStatus::Failed, "unknown to this broker".to_string()),
                };
                report.push(wanted, "feature flag", status, detail);
            }
        }
        Err(e) => report.push(
            "(broker)",
            "feature flags",
            CheckStatus::Failed,
            e.to_string(),
        ),
    }
    true
}

/// A parked queue created before lapse gave it a delivery limit: unlimited on RabbitMQ
/// 3.x, 20 on 4.x (a parked message returned 21 times is dropped, since the queue has
/// no dead-letter exchange). Said, not failed: on 3.x nothing is wrong, and on 4.x a
/// `delivery-limit` policy of -1 lifts the limit without moving the messages.
fn parked_limit_note(report: &mut VerifyReport, q: &QueueSpec, info: &QueueInfo) {
    let by_policy = match &info.effective_policy_definition {
        Some(Value::Object(def)) => def.get("delivery-limit").cloned(),
        _ => None,
    };
    let (status, detail) = match by_policy {
        Some(limit) => (
            CheckStatus::Ok,
            format!("created without x-delivery-limit; a policy sets delivery-limit {limit}"),
        ),
        None => (
            CheckStatus::Skipped,
            "created without x-delivery-limit: unlimited on RabbitMQ 3.x, but 20 on 4.x, where a parked message returned 21 times is dropped; on 4.x set a delivery-limit policy of -1 on it (docs/operations.md, \"Compatibility\")".to_string(),
        ),
    };
    report.push(&q.name, "delivery limit", status, detail);
}

/// One queue's exact arguments and the policies that would override them.
// Over 60 lines on purpose: two checks of one queue (exact arguments, overriding policies), each reported as it is made.
fn check_queue(report: &mut VerifyReport, q: &QueueSpec, info: &QueueInfo) {
    let mut problems = Vec::new();
    // The group size is checked as live members (see `replicas`), not as an argument;
    // a leader locator is compared only where the queue has one (queues created
    // before lapse set it have none, and keep the leader they have).
    for (key, want) in q.arguments.iter().filter(|(k, _)| *k != GROUP_SIZE_ARG) {
        let have = info.arguments.get(key);
        if key == LEADER_LOCATOR_ARG && have.is_none() {
            continue;
        }
        if super::parked_without_limit(q, key, have.is_none()) {
            parked_limit_note(report, q, info);
            continue;
        }
        if !same_value(want, have) {
            problems.push(format!("{key}: wants {want}, has {}", shown(have)));
        }
    }
    for key in info
        .arguments
        .keys()
        .filter(|k| !q.arguments.contains_key(*k) && *k != GROUP_SIZE_ARG)
    {
        problems.push(format!(
            "{key}: unexpected, has {}",
            shown(info.arguments.get(key))
        ));
    }
    if problems.is_empty() {
        report.push(
            &q.name,
            "exact arguments",
            CheckStatus::Ok,
            "as in the tier file",
        );
    } else {
        report.push(
            &q.name,
            "exact arguments",
            CheckStatus::Failed,
            problems.join("; "),
        );
    }
    let overriding: Vec<String> = match &info.effective_policy_definition {
        Some(Value::Object(def)) => def
            .keys()
            .filter(|k| GUARDED_POLICY_KEYS.contains(&k.as_str()))
            // The way to lift RabbitMQ 4.x's default limit from a parked queue
            // created without one (see `parked_limit_note`).
            .filter(|k| !(q.role == QueueRole::Parked && k.as_str() == "delivery-limit"))
            .cloned()
            .collect(),
        _ => Vec::new(),
    };
    if overriding.is_empty() {
        report.push(
            &q.name,
            "policies",
            CheckStatus::Ok,
            "none override the arguments",
        );
    } else {
        let names: Vec<&str> = [info.policy.as_deref(), info.operator_policy.as_deref()]
            .into_iter()
            .flatten()
            .collect();
        report.push(
            &q.name,
            "policies",
            CheckStatus::Failed,
            format!("policy {} sets {}", names.join(", "), overriding.join(", ")),
        );
    }
}

async fn check_bindings(
    report: &mut VerifyReport,
    m: &Management,
    vhost: &str,
    topology: &Topology,
) {
    for b in &topology.bindings {
        let subject = format!("{} -> {}", b.exchange, b.queue);
        match m.bindings(vhost, &b.exchange, &b.queue).await {
            Ok(list) if list.iter().any(|x| x.routing_key == b.routing_key) => report.push(
                &subject,
                "binding",
                CheckStatus::Ok,
                format!("key `{}`", b.routing_key),
            ),
            Ok(_) => report.push(
                &subject,
                "binding",
                CheckStatus::Failed,
                format!("missing binding with key `{}`", b.routing_key),
            ),
            Err(e) => report.push(&subject, "binding", CheckStatus::Failed, e.to_string()),
        }
    }
}

/// One queue's details; a failed request is tried twice more (a cluster node that
/// just went away can make one answer fail).
async fn queue_info(
    m: &Management,
    vhost: &str,
    name: &str,
) -> Result<Option<QueueInfo>, crate::amqp::management::ManagementError> {
    let mut tries = 0;
    loop {
        match m.queue(vhost, name).await {
            Err(_) if tries < 2 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            other => return other,
        }
    }
}

/// Members per quorum queue: fewer than `target` (the group size lapse wants), or a
/// member offline, is a queue that would lose its majority sooner than planned.
fn replicas(report: &mut VerifyReport, queue: &str, info: &QueueInfo, target: Option<u32>) {
    let Some(members) = &info.members else {
        return; // not a quorum queue (reported by the argument check) or an old API
    };
    let online = info.online.clone().unwrap_or_default();
    let offline: Vec<&str> = members
        .iter()
        .filter(|m| !online.contains(m))
        .map(String::as_str)
        .collect();
    let leader = info.leader.as_deref().unwrap_or("(none)");
    let mut detail = format!(
        "{} members ({}), leader {leader}",
        members.len(),
        members.join(", ")
    );
    if let Some(target) = target {
        detail.push_str(&format!(", target {target}"));
    }
    let below = target.is_some_and(|t| (members.len() as u32) < t);
    if below {
        detail.push_str(&format!(
            "; below target: add replicas with `rabbitmq-queues grow <node> all` or \
             `rabbitmq-queues add_member {queue} <node>`"
        ));
    }
    if !offline.is_empty() {
        detail.push_str(&format!("; offline: {}", offline.join(", ")));
    }
    let status = if below || !offline.is_empty() {
        CheckStatus::Failed
    } else {
        CheckStatus::Ok
    };
    report.push(queue, "replicas", status, detail);
}

fn same_value(want: &ArgValue, have: Option<&Value>) -> bool {
    match (want, have) {
        (ArgValue::Int(n), Some(Value::Number(v))) => v.as_i64() == Some(*n),
        (ArgValue::Str(s), Some(Value::String(v))) => s == v,
        _ => false,
    }
}

fn shown(v: Option<&Value>) -> String {
    match v {
        None => "(absent)".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}
