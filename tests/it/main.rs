//! Integration tests against the real RabbitMQ and PostgreSQL. Each test gets a
//! unique broker name prefix (and, where it needs one, a fresh database) and cleans
//! up after itself. Set `TEST_LOG=1` to see the library's logs.

mod ack_reset;
mod alarm;
mod backlog;
mod batch_reads;
mod bench;
mod chain;
mod cli_help;
mod cli_orders;
mod cli_startup;
mod cluster;
mod config_cli;
mod consumer_timeout;
mod demo;
mod endpoints;
mod helpers;
mod hostile_deadlines;
mod hostile_rows;
mod installed;
mod leadership;
mod legacy_rows;
mod liveness;
mod locks;
mod outage;
mod parked;
mod parked_replay;
mod pipeline;
mod private_cluster;
mod private_pg;
mod private_rabbit;
mod prometheus;
mod publish_faults;
mod queues;
mod reconciler_pacing;
mod redelivery;
mod release_repair;
mod release_window;
mod secrets;
mod shards;
mod silent_broker;
mod sql_surface;
mod status;
mod tcp_proxy;
mod tls;
mod topology;
