//! A private RabbitMQ cluster for tests, run by `scripts/cluster.sh` with its own
//! directory, node names and ports. Dropping it stops every node and deletes the
//! directory, also when the test failed.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use lapse::amqp::management::{Management, QueueInfo};
use lapse::config::Secret;

pub struct PrivateCluster {
    pub nodes: usize,
    name: String,
    port: u16,
    dir: tempfile::TempDir,
}

/// A first AMQP port such that the node's AMQP, management and distribution ports
/// (port + i, + 10000, + 20000) are all free right now.
fn free_port_block(nodes: usize) -> u16 {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        ^ std::process::id();
    for attempt in 0..200u32 {
        let base = 20_000 + ((seed.wrapping_add(attempt * 7_919)) % 20_000) as u16;
        let free = (0..nodes as u16).all(|i| {
            [0, 10_000, 20_000]
                .iter()
                .all(|off| TcpListener::bind(("127.0.0.1", base + i + off)).is_ok())
        });
        if free {
            return base;
        }
    }
    panic!("no free block of ports for a private cluster");
}

impl PrivateCluster {
    /// Starts `nodes` joined nodes; panics (after stopping them) when that fails.
    pub fn start(nodes: usize) -> Self {
        let port = free_port_block(nodes);
        let cluster = Self {
            nodes,
            name: format!("lapse-test-{port}"),
            port,
            dir: tempfile::Builder::new()
                .prefix("lapse-cluster-")
                .tempdir()
                .unwrap(),
        };
        let out = cluster.sh(&["start", &nodes.to_string()]);
        assert!(
            out.status.success(),
            "cluster.sh start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        cluster
    }

    fn sh(&self, args: &[&str]) -> Output {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/cluster.sh");
        Command::new("bash")
            .arg(script)
            .args(args)
            .env("LAPSE_CLUSTER_DIR", self.dir.path().join("c"))
            .env("LAPSE_CLUSTER_NAME", &self.name)
            .env("LAPSE_CLUSTER_PORT", self.port.to_string())
            .output()
            .expect("bash")
    }

    fn sh_ok(&self, args: &[&str]) {
        let out = self.sh(args);
        assert!(
            out.status.success(),
            "cluster.sh {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Every node's AMQP URL, comma-separated (a `broker.url` value).
    pub fn urls(&self) -> String {
        self.urls_from(1)
    }

    /// Every node's AMQP URL, node `first` first and the others after it in turn: a
    /// client connects to `first` while it answers.
    pub fn urls_from(&self, first: usize) -> String {
        (0..self.nodes)
            .map(|k| (first - 1 + k) % self.nodes + 1)
            .map(|i| {
                format!(
                    "amqp://guest:guest@127.0.0.1:{}/%2f",
                    self.port + i as u16 - 1
                )
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn management_url(&self, node: usize) -> String {
        format!(
            "http://guest:guest@127.0.0.1:{}",
            self.port + node as u16 - 1 + 10_000
        )
    }

    /// Node number (1-based) of an Erlang node name of this cluster.
    pub fn index_of(&self, node_name: &str) -> usize {
        node_name
            .strip_prefix(&format!("{}-", self.name))
            .and_then(|rest| rest.split('@').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{node_name} is not a node of this cluster"))
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&self, node: usize) {
        self.sh_ok(&["kill", &node.to_string()]);
    }

    pub fn stop_node(&self, node: usize) {
        self.sh_ok(&["node-stop", &node.to_string()]);
    }

    pub fn start_node(&self, node: usize) {
        self.sh_ok(&["node-start", &node.to_string()]);
    }

    /// A queue as the management API of any node that answers shows it.
    pub async fn queue(&self, name: &str) -> QueueInfo {
        for _ in 0..100 {
            for node in 1..=self.nodes {
                let m = Management::new(&Secret::new(self.management_url(node))).unwrap();
                if let Ok(Some(q)) = m.queue("/", name).await
                    && q.leader.is_some()
                {
                    return q;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("no node's management API shows queue {name} with a leader");
    }

    /// Waits until every node of the cluster runs again (after a restart).
    pub async fn wait_all_running(&self) {
        for _ in 0..300 {
            let out = self.sh(&["status"]);
            let text = String::from_utf8_lossy(&out.stdout);
            if text.matches(" running").count() == self.nodes {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("the cluster did not come back to {} nodes", self.nodes);
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let out = self.sh(&["stop"]);
        if !out.status.success() {
            eprintln!("cluster.sh stop: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
}
