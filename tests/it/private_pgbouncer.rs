//! A private PgBouncer (Debian's package) in front of the test PostgreSQL, on a port
//! of its own: every database of the server through `*`, trust authentication, no
//! `ignore_startup_parameters`. One transaction-mode instance is shared by the tests
//! that need it ([`shared`]); it stops when the test process ends (it reads its stdin,
//! which the test process holds open).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::helpers::{database_admin_url, free_port};

pub struct PrivatePgBouncer {
    pub port: u16,
    dir: PathBuf,
    child: Child,
}

fn pgbouncer_bin() -> PathBuf {
    for candidate in ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"] {
        if Path::new(candidate).exists() {
            return candidate.into();
        }
    }
    panic!(
        "PgBouncer is not installed: scripts/services.sh installs it (apt-get install pgbouncer)"
    )
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false)
}

impl PrivatePgBouncer {
    /// Starts one in `pool_mode` (`transaction` or `session`) and waits until it
    /// accepts connections.
    pub fn start(pool_mode: &str) -> Self {
        Self::start_with(pool_mode, 20)
    }

    /// [`PrivatePgBouncer::start`] with at most `pool_size` server connections per
    /// database and user.
    pub fn start_with(pool_mode: &str, pool_size: u32) -> Self {
        let upstream: tokio_postgres::Config = database_admin_url().parse().unwrap();
        let host = match upstream.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            _ => "127.0.0.1".into(),
        };
        let upstream_port = upstream.get_ports().first().copied().unwrap_or(5432);
        let user = upstream.get_user().unwrap_or("postgres").to_string();
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("lapse-pgb-{port}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("userlist.txt"), format!("\"{user}\" \"\"\n")).unwrap();
        let ini = format!(
            "[databases]\n* = host={host} port={upstream_port}\n\n[pgbouncer]\n\
             listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {dir}/userlist.txt\n\
             pool_mode = {pool_mode}\nmax_client_conn = 1000\ndefault_pool_size = {pool_size}\n\
             logfile = {dir}/pgbouncer.log\npidfile = {dir}/pgbouncer.pid\n\
             admin_users = {user}\n",
            dir = dir.display()
        );
        std::fs::write(dir.join("pgbouncer.ini"), ini).unwrap();
        // PgBouncer refuses to run as root.
        let root = is_root();
        if root {
            let _ = Command::new("chown")
                .args(["-R", "postgres:postgres", dir.to_str().unwrap()])
                .status();
        }
        // It stops when its stdin closes: when this value is dropped, or when the
        // test process ends without dropping it (a shared instance).
        let script = format!(
            "{bin} {dir}/pgbouncer.ini & pid=$!; cat >/dev/null; kill $pid; wait $pid; rm -rf {dir}",
            bin = pgbouncer_bin().display(),
            dir = dir.display()
        );
        let mut command = if root {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "sh", "-c", &script]);
            c
        } else {
            let mut c = Command::new("sh");
            c.args(["-c", &script]);
            c
        };
        let child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let bouncer = Self { port, dir, child };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "PgBouncer did not listen on {port}: {}",
                bouncer.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        bouncer
    }

    /// The URL of database `db` through this PgBouncer.
    pub fn url(&self, db: &str) -> String {
        let admin = database_admin_url();
        let upstream: tokio_postgres::Config = admin.parse().unwrap();
        let user = upstream.get_user().unwrap_or("postgres");
        format!("postgres://{user}@127.0.0.1:{}/{db}", self.port)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PrivatePgBouncer {
    fn drop(&mut self) {
        if let Some(mut stdin) = self.child.stdin.take() {
            let _ = stdin.flush();
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The transaction-mode PgBouncer the tests share.
pub fn shared() -> &'static PrivatePgBouncer {
    static SHARED: OnceLock<PrivatePgBouncer> = OnceLock::new();
    SHARED.get_or_init(|| PrivatePgBouncer::start("transaction"))
}
