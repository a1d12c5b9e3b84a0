//! No output of lapse ever contains a password: every error path, with a password in
//! every URL (broker, management API, database), through the binary, including a
//! worker's logs at the most verbose level.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::helpers::{run_lapse, stderr, stdout};

const PASSWORD: &str = "Pw7never7printed";

/// A port nothing listens on.
const CLOSED_PORT: u16 = 9;

struct Urls {
    broker: String,
    management: String,
    database: String,
}

impl Urls {
    /// Every URL carries [`PASSWORD`]; the servers are the local ones unless a port
    /// is given as closed.
    fn new(broker_port: u16, management_port: u16, database_port: u16, db: &str) -> Self {
        Self {
            broker: format!("amqp://guest:{PASSWORD}@127.0.0.1:{broker_port}/%2f"),
            management: format!("http://guest:{PASSWORD}@127.0.0.1:{management_port}"),
            database: format!("postgres://postgres:{PASSWORD}@127.0.0.1:{database_port}/{db}"),
        }
    }

    fn unreachable() -> Self {
        Self::new(CLOSED_PORT, CLOSED_PORT, CLOSED_PORT, "lapse")
    }

    fn toml(&self) -> String {
        format!(
            "[broker]\nurl = {:?}\nmanagement_url = {:?}\n\n[database]\nurl = {:?}\n",
            self.broker, self.management, self.database
        )
    }
}

struct Case {
    name: &'static str,
    config: String,
    env: Vec<(&'static str, String)>,
    args: &'static [&'static str],
    exit: i32,
}

fn assert_no_password(name: &str, text: &str) {
    assert!(
        !text.contains(PASSWORD),
        "{name}: the password was printed:\n{text}"
    );
}

#[test]
fn no_error_path_prints_a_password() {
    let dir = tempfile::tempdir().unwrap();
    let tiers = dir.path().join("tiers.toml");
    std::fs::write(&tiers, "tiers = [\"1s\", \"5s\"]").unwrap();
    let topology = format!("[topology]\nfile = {:?}\n", tiers.display().to_string());
    let local = Urls::new(5672, 15672, 5432, "postgres");
    let unterminated = |line: &str| {
        // The URL's closing quote is missing: a TOML syntax error on that very line.
        local
            .toml()
            .replace(&format!("{line:?}"), &format!("\"{line}"))
    };
    let cases = [
        Case {
            name: "syntax error on the broker URL line",
            config: unterminated(&local.broker),
            env: vec![],
            args: &["topology", "plan"],
            exit: 2,
        },
        Case {
            name: "syntax error on the management URL line",
            config: unterminated(&local.management),
            env: vec![],
            args: &["topology", "plan"],
            exit: 2,
        },
        Case {
            name: "syntax error on the database URL line",
            config: unterminated(&local.database),
            env: vec![],
            args: &["status"],
            exit: 2,
        },
        Case {
            name: "a URL given to a number key",
            config: format!(
                "{}\n[worker]\nprefetch = {:?}\n",
                local.toml(),
                local.database
            ),
            env: vec![],
            args: &["topology", "plan"],
            exit: 2,
        },
        Case {
            name: "a password with unencoded '#', '/' and '?' given to a number key",
            config: format!(
                "{}\n[worker]\nprefetch = \"postgres://u:{PASSWORD}#/x?y@127.0.0.1/db\"\n",
                local.toml()
            ),
            env: vec![],
            args: &["topology", "plan"],
            exit: 2,
        },
        Case {
            name: "a URL given to a number key by the environment",
            config: local.toml(),
            env: vec![("LAPSE_WORKER__BATCH_SIZE", local.broker.clone())],
            args: &["topology", "plan"],
            exit: 2,
        },
        Case {
            name: "an unparsable broker URL",
            config: local.toml().replace("127.0.0.1:5672", "127.0.0.1:notaport"),
            env: vec![],
            args: &["topology", "plan"],
            exit: 2,
        },
        Case {
            name: "an unparsable database URL",
            config: local.toml().replace("127.0.0.1:5432", "127.0.0.1:notaport"),
            env: vec![],
            args: &["migrate"],
            exit: 2,
        },
        Case {
            name: "the broker refuses the password",
            config: local.toml(),
            env: vec![],
            args: &["topology", "apply"],
            exit: 2,
        },
        Case {
            name: "the broker is unreachable",
            config: Urls::unreachable().toml(),
            env: vec![],
            args: &["status"],
            exit: 3,
        },
        Case {
            name: "the management API is unreachable",
            config: Urls::new(5672, CLOSED_PORT, 5432, "postgres").toml(),
            env: vec![],
            args: &["topology", "verify"],
            exit: 2, // the broker refuses this password before the API is asked
        },
        Case {
            name: "the database is unreachable",
            config: Urls::unreachable().toml(),
            env: vec![],
            args: &["order", "show", "1"],
            exit: 3,
        },
        Case {
            name: "the database is unreachable for a migration",
            config: Urls::unreachable().toml(),
            env: vec![],
            args: &["migrate"],
            exit: 3,
        },
        Case {
            name: "the database does not exist",
            config: Urls::new(5672, 15672, 5432, "lapse_no_such_database_x").toml(),
            env: vec![],
            args: &["order", "show", "1"],
            exit: 2,
        },
        Case {
            name: "the database URL comes from the environment",
            config: String::new(),
            env: vec![(
                "LAPSE_DATABASE__URL",
                format!("host=127.0.0.1 port={CLOSED_PORT} user=postgres password={PASSWORD}"),
            )],
            args: &["order", "show", "1"],
            exit: 3,
        },
    ];
    for case in cases {
        let config = dir.path().join("lapse.toml");
        std::fs::write(&config, format!("{topology}{}", case.config)).unwrap();
        let mut args = vec!["--config", config.to_str().unwrap()];
        args.extend_from_slice(case.args);
        let env: Vec<(&str, &str)> = case.env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let out = run_lapse(&args, &env);
        let (out_text, err_text) = (stdout(&out), stderr(&out));
        assert_eq!(
            out.status.code(),
            Some(case.exit),
            "{}: {err_text}",
            case.name
        );
        assert!(!err_text.is_empty(), "{}: no error message", case.name);
        assert_no_password(case.name, &out_text);
        assert_no_password(case.name, &err_text);
    }
}

#[test]
fn a_worker_logging_everything_prints_no_password() {
    let dir = tempfile::tempdir().unwrap();
    let tiers = dir.path().join("tiers.toml");
    std::fs::write(&tiers, "tiers = [\"1s\"]").unwrap();
    let config = dir.path().join("lapse.toml");
    std::fs::write(
        &config,
        format!(
            "[topology]\nfile = {:?}\n{}\n[worker]\nmigrate_on_start = false\n",
            tiers.display().to_string(),
            Urls::unreachable().toml()
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_lapse"))
        .args(["--config", config.to_str().unwrap(), "worker"])
        .env("RUST_LOG", "trace")
        .env_remove("LAPSE_LOG_FORMAT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Long enough for several reconnect attempts of every component.
    std::thread::sleep(Duration::from_secs(3));
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let out = child.wait_with_output().unwrap();
    let err_text = stderr(&out);
    assert!(
        err_text.contains("127.0.0.1"),
        "the worker logged its connection attempts: {err_text}"
    );
    assert_no_password("worker logs", &err_text);
    assert_no_password("worker output", &stdout(&out));
}
