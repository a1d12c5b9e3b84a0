//! A private RabbitMQ node on free loopback ports, with its own node name, data
//! directory, config file, enabled-plugins file and HOME (its Erlang cookie), for
//! tests that raise resource alarms or need a TLS listener. Never touches the shared
//! broker. Dropping it stops the node and deletes its directory, also when the test
//! failed.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const BIN: &str = "/usr/lib/rabbitmq/bin";

/// Certificates a test generated: a CA and a server certificate it signed for
/// `127.0.0.1` and `localhost`, as PEM files.
pub struct TestCertificates {
    pub ca_file: PathBuf,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

impl TestCertificates {
    /// Generates a fresh CA and server certificate into `dir`.
    pub fn generate(dir: &Path) -> Self {
        Self::generate_for(dir, &["127.0.0.1", "localhost"])
    }

    /// Like [`Self::generate`], with a server certificate for `names` only.
    pub fn generate_for(dir: &Path, names: &[&str]) -> Self {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "lapse test CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca, ca_key);

        let server_key = KeyPair::generate().unwrap();
        let mut server =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        server
            .distinguished_name
            .push(DnType::CommonName, "lapse test broker");
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_cert = server.signed_by(&server_key, &issuer).unwrap();

        let certs = Self {
            ca_file: dir.join("ca.pem"),
            cert_file: dir.join("server.pem"),
            key_file: dir.join("server.key"),
        };
        std::fs::write(&certs.ca_file, ca_cert.pem()).unwrap();
        std::fs::write(&certs.cert_file, server_cert.pem()).unwrap();
        std::fs::write(&certs.key_file, server_key.serialize_pem()).unwrap();
        certs
    }
}

/// What to run besides the plain AMQP listener.
#[derive(Default)]
pub struct NodeOptions<'a> {
    /// An AMQPS listener (and, with `management`, an HTTPS management listener)
    /// using these certificates; clients are not asked for a certificate.
    pub tls: Option<&'a TestCertificates>,
    pub management: bool,
}

pub struct PrivateRabbit {
    pub node: String,
    pub amqp_port: u16,
    pub tls_port: u16,
    pub management_tls_port: u16,
    dir: PathBuf,
    os_pid: Option<String>,
}

pub use crate::helpers::free_port;

/// Boots tried before a test gives up: a port taken between the check and the node's
/// bind (by another test's server) stops the node, and a fresh set of ports fixes it.
const BOOT_ATTEMPTS: usize = 3;

impl PrivateRabbit {
    /// A node with only a plain AMQP listener.
    pub fn start() -> Self {
        Self::start_with(NodeOptions::default())
    }

    pub fn start_with(options: NodeOptions<'_>) -> Self {
        let mut failures = Vec::new();
        for _ in 0..BOOT_ATTEMPTS {
            let mut node = Self::prepare(&options);
            match node.boot() {
                Ok(()) => return node,
                // Dropping the node stops what is left of it and deletes its directory.
                Err(failure) => failures.push(failure),
            }
        }
        panic!(
            "private RabbitMQ node did not start in {BOOT_ATTEMPTS} attempts:\n{}",
            failures.join("\n---\n")
        )
    }

    /// A node's directory, cookie and config on fresh ports, not yet started.
    fn prepare(options: &NodeOptions<'_>) -> Self {
        let amqp_port = free_port();
        let dir =
            std::env::temp_dir().join(format!("lapse-rabbit-{amqp_port}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["home", "mnesia", "log"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        let node = Self {
            node: format!("lapse-test-{amqp_port}@localhost"),
            amqp_port,
            tls_port: free_port(),
            management_tls_port: free_port(),
            dir,
            os_pid: None,
        };
        // Our own cookie, written before the node or any CLI call could create one.
        let cookie = node.dir.join("home/.erlang.cookie");
        std::fs::write(&cookie, format!("LAPSETEST{amqp_port}COOKIE")).unwrap();
        let _ = Command::new("chmod").arg("400").arg(&cookie).status();
        node.write_config(options);
        node
    }

    fn write_config(&self, options: &NodeOptions<'_>) {
        let mut conf = format!("listeners.tcp.default = 127.0.0.1:{}\n", self.amqp_port);
        let mut plugins = Vec::new();
        if let Some(certs) = options.tls {
            let files = format!(
                "cacertfile = {}\ncertfile = {}\nkeyfile = {}\n",
                certs.ca_file.display(),
                certs.cert_file.display(),
                certs.key_file.display()
            );
            conf.push_str(&format!(
                "listeners.ssl.default = 127.0.0.1:{}\nssl_options.verify = verify_none\n\
                 ssl_options.fail_if_no_peer_cert = false\n",
                self.tls_port
            ));
            for line in files.lines() {
                conf.push_str(&format!("ssl_options.{line}\n"));
            }
            if options.management {
                plugins.push("rabbitmq_management");
                conf.push_str(&format!(
                    "management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {}\n\
                     management.ssl.ip = 127.0.0.1\nmanagement.ssl.port = {}\n",
                    free_port(),
                    self.management_tls_port
                ));
                for line in files.lines() {
                    conf.push_str(&format!("management.ssl.{line}\n"));
                }
            }
        }
        std::fs::write(self.dir.join("rabbitmq.conf"), conf).unwrap();
        std::fs::write(
            self.dir.join("enabled_plugins"),
            format!("[{}].\n", plugins.join(",")),
        )
        .unwrap();
    }

    fn boot(&mut self) -> Result<(), String> {
        let d = |p: &str| self.dir.join(p).display().to_string();
        let started = Command::new(format!("{BIN}/rabbitmq-server"))
            .arg("-detached")
            .current_dir(&self.dir)
            .env("HOME", d("home"))
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.amqp_port.to_string())
            .env("RABBITMQ_DIST_PORT", free_port().to_string())
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_MNESIA_BASE", d("mnesia"))
            .env("RABBITMQ_LOG_BASE", d("log"))
            .env("RABBITMQ_CONFIG_FILE", d("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d("enabled_plugins"))
            .status()
            .expect("rabbitmq-server (scripts/services.sh installs it)");
        if !started.success() {
            return Err(format!(
                "rabbitmq-server -detached failed\n{}",
                self.log_tail()
            ));
        }
        // `await_startup` fails while the node is still coming up: retry.
        let booted = Instant::now();
        let until = booted + Duration::from_secs(90);
        loop {
            let out = self.ctl(&["await_startup", "--timeout", "30"]);
            if out.status.success() {
                break;
            }
            // A node that stopped (its listener could not bind, say) never comes up:
            // give up on it early and let the caller try fresh ports.
            let gone = String::from_utf8_lossy(&out.stderr).contains("not running at all")
                && booted.elapsed() > Duration::from_secs(10);
            if gone || Instant::now() >= until {
                return Err(format!(
                    "{}\n{}",
                    String::from_utf8_lossy(&out.stderr),
                    self.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let pid = self.ctl(&["eval", "os:getpid()."]);
        self.os_pid = Some(
            String::from_utf8_lossy(&pid.stdout)
                .trim()
                .trim_matches('"')
                .to_string(),
        );
        for flag in ["quorum_queue", "stream_queue"] {
            let out = self.ctl(&["enable_feature_flag", flag]);
            if !out.status.success() {
                return Err(format!("enable_feature_flag {flag} failed"));
            }
        }
        Ok(())
    }

    /// Runs `rabbitmqctl -n NODE args...` with this node's HOME (cookie).
    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(format!("{BIN}/rabbitmqctl"))
            .env("HOME", self.dir.join("home"))
            .arg("-n")
            .arg(&self.node)
            .args(args)
            .output()
            .expect("rabbitmqctl")
    }

    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    /// The node's active alarms, as Erlang terms (`[]` when none).
    pub fn alarms(&self) -> String {
        let out = self.ctl(&["eval", "rabbit_alarm:get_alarms()."]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Raises the memory alarm (a watermark below what the node uses) and waits until
    /// the node reports it.
    pub fn raise_memory_alarm(&self) {
        let out = self.ctl(&["set_vm_memory_high_watermark", "0.000001"]);
        assert!(out.status.success(), "set_vm_memory_high_watermark");
        self.wait_alarms(|a| a.contains("memory"), "the memory alarm raised");
    }

    /// Restores the default watermark and waits until the alarm has cleared.
    pub fn clear_memory_alarm(&self) {
        let out = self.ctl(&["set_vm_memory_high_watermark", "0.4"]);
        assert!(out.status.success(), "set_vm_memory_high_watermark");
        self.wait_alarms(|a| a == "[]", "the memory alarm cleared");
    }

    fn wait_alarms(&self, done: impl Fn(&str) -> bool, what: &str) {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let alarms = self.alarms();
            if done(&alarms) {
                return;
            }
            assert!(
                Instant::now() < until,
                "timed out waiting for {what}: {alarms}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `rabbitmqctl list_queues` columns for queues whose name starts with `prefix`.
    pub fn queue_counts(&self, prefix: &str) -> Vec<(String, u64, u64)> {
        let out = self.ctl(&[
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|line| {
                let mut cols = line.split_whitespace();
                let name = cols.next()?;
                let ready = cols.next()?.parse().ok()?;
                let unacked = cols.next()?.parse().ok()?;
                name.starts_with(prefix)
                    .then(|| (name.to_string(), ready, unacked))
            })
            .collect()
    }

    fn log_tail(&self) -> String {
        let log = self.dir.join("log").join(format!("{}.log", self.node));
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        let stopped = self.ctl(&["stop"]).status.success();
        if !stopped && let Some(pid) = &self.os_pid {
            let _ = Command::new("kill").args(["-9", pid]).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
