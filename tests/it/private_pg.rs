//! A private PostgreSQL instance on its own port and data directory, for tests that
//! stop and start the database. Never touches the shared server.

use std::path::PathBuf;
use std::process::Command;

pub struct PrivatePostgres {
    pub port: u16,
    dir: PathBuf,
    bin: PathBuf,
}

fn pg_bin() -> PathBuf {
    let root = PathBuf::from("/usr/lib/postgresql");
    let mut versions: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("PostgreSQL server binaries under /usr/lib/postgresql")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    versions.sort();
    versions.pop().expect("a PostgreSQL version").join("bin")
}

/// Runs a server binary as the `postgres` user when we are root (initdb refuses root).
fn as_postgres(bin: &std::path::Path, args: &[&str]) -> Command {
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false);
    if is_root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin).args(args);
        c
    } else {
        let mut c = Command::new(bin);
        c.args(args);
        c
    }
}

impl PrivatePostgres {
    pub fn start(port: u16) -> Self {
        let dir = std::env::temp_dir().join(format!("lapse-pg-{port}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let _ = Command::new("chown")
            .args(["postgres:postgres", dir.to_str().unwrap()])
            .status();
        let pg = Self {
            port,
            dir,
            bin: pg_bin(),
        };
        let data = pg.data();
        let ok = as_postgres(
            &pg.bin.join("initdb"),
            &["-D", &data, "-U", "postgres", "--auth=trust", "-E", "UTF8"],
        )
        .output()
        .unwrap();
        assert!(
            ok.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&ok.stderr)
        );
        pg.start_server();
        pg
    }

    /// A server that accepts only TLS connections (`hostnossl` rejected), with the
    /// server certificate and key of `certs`.
    pub fn start_tls(port: u16, certs: &crate::private_rabbit::TestCertificates) -> Self {
        let pg = Self::start(port);
        pg.stop_server();
        let data = std::path::PathBuf::from(pg.data());
        for (from, to) in [
            (&certs.cert_file, "server.crt"),
            (&certs.key_file, "server.key"),
        ] {
            std::fs::copy(from, data.join(to)).unwrap();
            let _ = Command::new("chown")
                .args(["postgres:postgres", data.join(to).to_str().unwrap()])
                .status();
        }
        let _ = Command::new("chmod")
            .args(["600", data.join("server.key").to_str().unwrap()])
            .status();
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .unwrap();
        use std::io::Write;
        writeln!(
            conf,
            "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'"
        )
        .unwrap();
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhostnossl all all 0.0.0.0/0 reject\nhostnossl all all ::/0 reject\n\
             hostssl all all 0.0.0.0/0 trust\nhostssl all all ::/0 trust\n",
        )
        .unwrap();
        pg.start_server();
        pg
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    pub fn start_server(&self) {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("log").display().to_string();
        let out = as_postgres(
            &self.bin.join("pg_ctl"),
            &[
                "-D",
                &self.data(),
                "-o",
                &options,
                "-l",
                &log,
                "-w",
                "start",
            ],
        )
        .output()
        .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn stop_server(&self) {
        let _ = as_postgres(
            &self.bin.join("pg_ctl"),
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        )
        .output();
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.stop_server();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
