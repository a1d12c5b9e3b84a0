//! The background components `lapse worker` runs: the due-queue consumer, the relay,
//! the releaser, the sweeper with its reconciler, and the queue gauges.

pub mod consumer;
pub mod queue_gauges;
pub mod reconciler;
pub mod relay;
pub mod releaser;
pub mod retention;
pub mod sweeper;
