//! `broker.url` may name several broker nodes: AMQP URLs separated by commas
//! (a comma inside a password is written `%2C`). lapse connects to one at a time and,
//! when that fails or a connection is lost, tries the others in order.
//!
//! Invariant: every connection attempt starts at the address that worked last, so
//! the components of one worker follow the cluster together instead of probing a
//! dead node each time.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Which address to try first, shared by every clone of an endpoint.
#[derive(Clone, Debug, Default)]
pub(crate) struct Cursor(Arc<AtomicUsize>);

impl Cursor {
    /// Indexes of `count` addresses, starting at the last one that worked.
    pub(crate) fn order(&self, count: usize) -> impl Iterator<Item = usize> {
        let start = self.0.load(Ordering::Relaxed) % count.max(1);
        (0..count).map(move |i| (start + i) % count)
    }

    pub(crate) fn worked(&self, index: usize) {
        self.0.store(index, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_order_starts_at_the_address_that_worked_last() {
        let cursor = Cursor::default();
        assert_eq!(cursor.order(3).collect::<Vec<_>>(), [0, 1, 2]);
        cursor.clone().worked(2);
        assert_eq!(cursor.order(3).collect::<Vec<_>>(), [2, 0, 1]);
        assert_eq!(cursor.order(1).collect::<Vec<_>>(), [0]);
    }
}
