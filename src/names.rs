//! The names of one deployment's broker objects, all derived from the prefix, and
//! the routing keys that join them: plain strings, known to the domain (a timeout
//! message names its next route) and to the broker adapters alike.

use crate::tier::Tier;

/// Routing key under which wait queues dead-letter into the due exchange.
pub const DUE_ROUTING_KEY: &str = "due";
/// Routing key of stock-release events on the events exchange.
pub const STOCK_RELEASE_ROUTING_KEY: &str = "stock.release";

/// Broker object names of one deployment, all derived from the prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    pub prefix: String,
}

impl Names {
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }
    pub fn delay_exchange(&self) -> String {
        format!("{}.delay", self.prefix)
    }
    pub fn due_exchange(&self) -> String {
        format!("{}.due", self.prefix)
    }
    pub fn due_queue(&self) -> String {
        format!("{}.due", self.prefix)
    }
    pub fn parked(&self) -> String {
        format!("{}.parked", self.prefix)
    }
    pub fn events_exchange(&self) -> String {
        format!("{}.events", self.prefix)
    }
    pub fn stock_release_queue(&self) -> String {
        format!("{}.stock.release", self.prefix)
    }
    pub fn wait_queue_prefix(&self) -> String {
        format!("{}.wait.", self.prefix)
    }
    pub fn wait_queue(&self, tier: Tier) -> String {
        format!("{}{}", self.wait_queue_prefix(), tier.name())
    }
}
