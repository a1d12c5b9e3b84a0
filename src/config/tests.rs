//! Configuration loading and validation, tested with figment's `Jail`.
// figment's Jail closures return its (large) error type by design.
#![allow(clippy::result_large_err)]

use std::path::Path;
use std::str::FromStr;

use super::*;
use figment::providers::{Format, Toml};
use figment::{Figment, Jail};

/// Loads as `lapse` does without `--config`, in the jail's working directory.
fn load() -> Result<Config, ConfigError> {
    Config::load(Path::new(DEFAULT_CONFIG_FILE), false)
}

#[test]
fn defaults_without_a_file() {
    Jail::expect_with(|_jail| {
        let config = load().unwrap();
        assert_eq!(config.broker.prefix, "lapse");
        assert_eq!(config.relay.tier_tolerance, Duration::from_millis(50));
        assert_eq!(config.worker.tier_tolerance, None);
        Ok(())
    });
}

#[test]
fn no_tier_file_configured_means_the_built_in_tiers() {
    Jail::expect_with(|_jail| {
        // The jail's directory has no topology/ folder.
        let tiers = load().unwrap().tier_file().unwrap();
        assert_eq!(tiers.source, crate::tier_file::TierSource::BuiltIn);
        assert_eq!(tiers, crate::tier_file::TierFile::built_in());
        Ok(())
    });
}

#[test]
fn a_configured_tier_file_that_is_missing_names_the_key_and_the_path() {
    Jail::expect_with(|jail| {
        jail.create_file("lapse.toml", "[topology]\nfile = \"tiers/shop.toml\"")?;
        let e = load().unwrap_err();
        assert_eq!(e.key, "topology.file");
        assert!(e.problem.contains("tiers/shop.toml"), "{e}");
        assert!(e.problem.contains("working directory"), "{e}");
        jail.create_dir("tiers")?;
        jail.create_file("tiers/shop.toml", "tiers = [\"2s\"]")?;
        let tiers = load().unwrap().tier_file().unwrap();
        assert_eq!(
            tiers.tiers.iter().map(|t| t.name()).collect::<Vec<_>>(),
            ["2s"]
        );
        Ok(())
    });
}

#[test]
fn the_logging_variables_are_not_configuration_keys() {
    Jail::expect_with(|jail| {
        jail.set_env("LAPSE_LOG", "debug");
        jail.set_env("LAPSE_LOG_FORMAT", "json");
        jail.set_env("LAPSE_BENCH_WORKER_LOG", "warn");
        assert!(load().is_ok());
        // Any other top-level LAPSE_ variable is still an unknown key.
        jail.set_env("LAPSE_LOGS", "debug");
        assert_eq!(load().unwrap_err().key, "logs");
        Ok(())
    });
}

#[test]
fn env_overrides_file() {
    Jail::expect_with(|jail| {
        jail.create_file(
            "lapse.toml",
            "[broker]\nprefix = \"from-file\"\n[worker]\nbatch_window = \"7ms\"",
        )?;
        jail.set_env("LAPSE_BROKER__PREFIX", "from-env");
        let config = load().unwrap();
        assert_eq!(config.broker.prefix, "from-env");
        assert_eq!(config.worker.batch_window, Duration::from_millis(7));
        assert_eq!(
            config.worker.release_batch_window,
            Duration::from_millis(50),
            "the releaser's own window keeps its default"
        );
        Ok(())
    });
}

#[test]
fn errors_name_the_key_and_hide_secrets() {
    Jail::expect_with(|jail| {
        let cases = [
            ("[broker]\ncolour = 1", "broker.colour"),
            (
                "[worker]\ntier_tolerance = \"soon\"",
                "worker.tier_tolerance",
            ),
            ("[broker]\nurl = \"http://guest:s3cret@x\"", "broker.url"),
            ("[database]\nurl = \"::s3cret::\"", "database.url"),
            ("[broker]\nprefix = \"a b\"", "broker.prefix"),
            ("[sweeper]\nrelease_grace = \"0s\"", "sweeper.release_grace"),
            (
                "[sweeper]\nrelease_grace = \"2s\"\n[worker]\nrelease_batch_window = \"2s\"",
                "sweeper.release_grace",
            ),
        ];
        for (text, key) in cases {
            jail.create_file("lapse.toml", text)?;
            let err = load().unwrap_err();
            assert_eq!(err.key, key, "{text}");
            assert!(!err.to_string().contains("s3cret"), "{err}");
        }
        Ok(())
    });
}

#[test]
fn debug_hides_credentials() {
    let mut config = Config::default();
    config.broker.url = Secret::new("amqp://u:s3cret@h/");
    assert!(!format!("{config:?}").contains("s3cret"));
}

#[test]
fn the_deadline_horizon_defaults_to_366_days_and_is_bounded() {
    Jail::expect_with(|jail| {
        assert_eq!(
            load().unwrap().orders.deadline_horizon,
            Duration::from_secs(366 * 86_400)
        );
        jail.create_file("lapse.toml", "[orders]\ndeadline_horizon = \"30days\"")?;
        assert_eq!(
            load().unwrap().orders.deadline_horizon,
            Duration::from_secs(30 * 86_400)
        );
        for bad in ["0s", "101years"] {
            jail.create_file(
                "lapse.toml",
                &format!("[orders]\ndeadline_horizon = \"{bad}\""),
            )?;
            assert_eq!(load().unwrap_err().key, "orders.deadline_horizon", "{bad}");
        }
        Ok(())
    });
}

#[test]
fn intervals_that_would_spin_or_switch_a_protection_off_are_refused() {
    Jail::expect_with(|jail| {
        let cases = [
            ("[sweeper]\ninterval = \"0s\"", "sweeper.interval"),
            ("[sweeper]\nlease = \"500ms\"", "sweeper.lease"),
            ("[sweeper]\nlease = \"2days\"", "sweeper.lease"),
            ("[relay]\npoll_interval = \"0s\"", "relay.poll_interval"),
            ("[relay]\npoll_interval = \"500us\"", "relay.poll_interval"),
            ("[worker]\nlock_retry = \"0s\"", "worker.lock_retry"),
            ("[worker]\nlock_retry = \"3y\"", "worker.lock_retry"),
            ("[worker]\nstall_limit = \"0s\"", "worker.stall_limit"),
            ("[worker]\nbatch_window = \"1h\"", "worker.batch_window"),
            (
                "[worker]\nrelease_batch_window = \"11s\"",
                "worker.release_batch_window",
            ),
            (
                "[database]\nstatement_timeout = \"0s\"",
                "database.statement_timeout",
            ),
            (
                "[database]\nstatement_timeout = \"30days\"",
                "database.statement_timeout",
            ),
            ("[database]\nlock_timeout = \"0s\"", "database.lock_timeout"),
            (
                "[broker]\nconsumer_timeout = \"1s\"",
                "broker.consumer_timeout",
            ),
            (
                "[broker]\nconsumer_timeout = \"60days\"",
                "broker.consumer_timeout",
            ),
            (
                "[broker]\nconsumer_timeout = \"10m\"\n[worker]\nlock_retry = \"3m\"",
                "worker.lock_retry",
            ),
            (
                "[broker]\nconsumer_timeout = \"10m\"\n[worker]\ncloses_per_second = 5",
                "worker.prefetch",
            ),
            ("[broker]\nheartbeat = \"0s\"", "broker.heartbeat"),
            ("[broker]\nheartbeat = \"500ms\"", "broker.heartbeat"),
            ("[broker]\nheartbeat = \"1day\"", "broker.heartbeat"),
            (
                "[broker]\nurl = \"amqp://u:p@h:5672/%2f?heartbeat=0\"",
                "broker.url",
            ),
        ];
        for (text, key) in cases {
            jail.create_file("lapse.toml", text)?;
            let err = load().unwrap_err();
            assert_eq!(err.key, key, "{text}");
        }
        jail.create_file(
            "lapse.toml",
            "[sweeper]\ninterval = \"1ms\"\n[relay]\npoll_interval = \"1ms\"\n[broker]\nheartbeat = \"1s\"",
        )?;
        load().unwrap();
        Ok(())
    });
}

#[test]
fn the_heartbeat_goes_into_the_workers_broker_url_unless_the_url_has_one() {
    let mut broker = Config::default().broker;
    assert_eq!(broker.heartbeat, Duration::from_secs(5));
    broker.url = Secret::new("amqp://u:p%40ss@h:5672/%2f");
    assert_eq!(
        broker.url_with_heartbeat().expose(),
        "amqp://u:p%40ss@h:5672/%2f?heartbeat=5"
    );
    broker.url = Secret::new("amqp://u:p@h/vh?frame_max=8192");
    assert_eq!(
        broker.url_with_heartbeat().expose(),
        "amqp://u:p@h/vh?frame_max=8192&heartbeat=5"
    );
    broker.url = Secret::new("amqp://u:p@h/%2f?heartbeat=3");
    assert_eq!(
        broker.url_with_heartbeat().expose(),
        "amqp://u:p@h/%2f?heartbeat=3"
    );
    let parsed =
        lapin::uri::AMQPUri::from_str(Config::default().broker.url_with_heartbeat().expose())
            .unwrap();
    assert_eq!(parsed.query.heartbeat, Some(5));
    assert_eq!(parsed.vhost, "/");
}

#[test]
fn a_drain_timeout_that_would_abandon_every_shutdown_is_refused() {
    Jail::expect_with(|jail| {
        for text in [
            "[worker]\ndrain_timeout = \"0s\"",
            "[worker]\ndrain_timeout = \"10ms\"",
        ] {
            jail.create_file("lapse.toml", text)?;
            let err = load().unwrap_err();
            assert_eq!(err.key, "worker.drain_timeout", "{text}");
        }
        jail.create_file("lapse.toml", "[worker]\ndrain_timeout = \"1s\"")?;
        load().unwrap();
        Ok(())
    });
}

/// `worker.tier_tolerance` moved to `relay.tier_tolerance`: the old key still works,
/// with a warning; the new one wins when both are set.
#[test]
fn a_moved_key_still_works_with_a_deprecation_warning() {
    Jail::expect_with(|jail| {
        let user = |jail: &mut Jail, text: &str| -> figment::Result<Figment> {
            jail.create_file("lapse.toml", text)?;
            Ok(Figment::new()
                .merge(Toml::file(DEFAULT_CONFIG_FILE))
                .merge(env()))
        };

        let (_, warnings) = moved_keys(user(jail, "[relay]\ntier_tolerance = \"30ms\"")?);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(
            load().unwrap().relay.tier_tolerance,
            Duration::from_millis(30)
        );

        let (_, warnings) = moved_keys(user(jail, "[worker]\ntier_tolerance = \"20ms\"")?);
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0]
                .contains("`worker.tier_tolerance` is deprecated; use `relay.tier_tolerance`"),
            "{warnings:?}"
        );
        assert_eq!(
            load().unwrap().relay.tier_tolerance,
            Duration::from_millis(20)
        );

        jail.set_env("LAPSE_WORKER__TIER_TOLERANCE", "25ms");
        let (_, warnings) = moved_keys(user(jail, "")?);
        assert_eq!(warnings.len(), 1, "the environment counts too");
        assert_eq!(
            load().unwrap().relay.tier_tolerance,
            Duration::from_millis(25)
        );

        let both = "[worker]\ntier_tolerance = \"20ms\"\n[relay]\ntier_tolerance = \"40ms\"";
        let (_, warnings) = moved_keys(user(jail, both)?);
        assert!(
            warnings[0].contains("ignored because `relay.tier_tolerance` is set"),
            "{warnings:?}"
        );
        assert_eq!(
            load().unwrap().relay.tier_tolerance,
            Duration::from_millis(40)
        );
        Ok(())
    });
}

#[test]
fn shards_list_every_database_and_name_components_per_shard() {
    Jail::expect_with(|jail| {
        let config = load().unwrap();
        assert!(!config.database.sharded());
        let single = config.database.shard_list();
        assert_eq!(single.len(), 1);
        assert_eq!(single[0].url, config.database.url);
        assert_eq!(config.database.per_shard("relay", 0), "relay");

        jail.create_file(
            "lapse.toml",
            "[database]\nshards = [\"postgres://u:pw@h1/a\", \"postgres://u:pw@h2/a\"]",
        )?;
        let config = load().unwrap();
        let shards = config.database.shard_list();
        assert_eq!(shards.len(), 2);
        assert_eq!(
            (shards[1].index, shards[1].url.expose()),
            (1, "postgres://u:pw@h2/a")
        );
        assert_eq!(config.database.per_shard("relay", 1), "relay.s1");
        assert!(!format!("{config:?}").contains("pw"), "{config:?}");
        Ok(())
    });
}

#[test]
fn shards_from_the_environment_are_a_bracketed_list() {
    Jail::expect_with(|jail| {
        jail.set_env(
            "LAPSE_DATABASE__SHARDS",
            "[\"postgres://u:pw@h/a\", \"postgres://u:pw@h/b\"]",
        );
        let config = load().unwrap();
        let urls: Vec<_> = config
            .database
            .shard_list()
            .iter()
            .map(|s| s.url.expose().to_string())
            .collect();
        assert_eq!(urls, ["postgres://u:pw@h/a", "postgres://u:pw@h/b"]);
        // One variable per entry is not a list: an error naming the key.
        jail.clear_env();
        jail.set_env("LAPSE_DATABASE__SHARDS__0", "postgres://u:pw@h/a");
        let error = load().unwrap_err();
        assert!(error.key.starts_with("database.shards"), "{error}");
        assert!(!error.to_string().contains("pw"), "{error}");
        Ok(())
    });
}

#[test]
fn bad_shard_lists_name_the_key_and_hide_the_urls() {
    Jail::expect_with(|jail| {
        let many: Vec<String> = (0..=MAX_SHARDS)
            .map(|i| format!("\"postgres://u:s3cret@h/db{i}\""))
            .collect();
        let many = format!("[database]\nshards = [{}]", many.join(", "));
        let cases = [
            ("[database]\nshards = []", "database.shards", "at least one"),
            (
                "[database]\nshards = [\"postgres://u:s3cret@h/a\", \"postgres://v:s3cret@h:5432/a\"]",
                "database.shards",
                "shard 1 names the same database as shard 0",
            ),
            (
                "[database]\nshards = [\"postgres://u:s3cret@h/a\", \"::s3cret::\"]",
                "database.shards",
                "shard 1 is not a valid",
            ),
            (&many, "database.shards", "at most 256"),
            (
                "[database]\nurl = \"postgres://u:s3cret@h/a\"\nshards = [\"postgres://u:s3cret@h/b\"]",
                "database.url",
                "together with database.shards",
            ),
        ];
        for (text, key, problem) in cases {
            jail.create_file("lapse.toml", text)?;
            let error = load().unwrap_err();
            assert_eq!(error.key, key, "{text}: {error}");
            assert!(error.problem.contains(problem), "{text}: {error}");
            assert!(!error.to_string().contains("s3cret"), "{error}");
        }
        // The environment's database.url with a file's shards is the same mistake.
        jail.create_file("lapse.toml", "[database]\nshards = [\"postgres://h/b\"]")?;
        jail.set_env("LAPSE_DATABASE__URL", "postgres://h/a");
        assert_eq!(load().unwrap_err().key, "database.url");
        Ok(())
    });
}

#[test]
fn a_smallest_tier_longer_than_the_hold_limit_is_refused_naming_both() {
    Jail::expect_with(|jail| {
        // Half of 3 s is 1.5 s; the built-in tiers start at 1 s: fine.
        jail.create_file("lapse.toml", "[broker]\nconsumer_timeout = \"3s\"")?;
        load().unwrap();
        jail.create_file("tiers.toml", "tiers = [\"5s\", \"1m\"]")?;
        jail.create_file(
            "lapse.toml",
            "[broker]\nconsumer_timeout = \"3s\"\n[topology]\nfile = \"tiers.toml\"",
        )?;
        let err = load().unwrap_err();
        assert_eq!(err.key, "broker.consumer_timeout");
        assert!(err.problem.contains("5s"), "{}", err.problem);
        assert!(err.problem.contains("tiers.toml"), "{}", err.problem);
        // The broker's default (30 min) takes a tier file starting at 10 minutes.
        jail.create_file("tiers.toml", "tiers = [\"10m\"]")?;
        jail.create_file("lapse.toml", "[topology]\nfile = \"tiers.toml\"")?;
        load().unwrap();
        jail.create_file("tiers.toml", "tiers = [\"16m\"]")?;
        assert_eq!(load().unwrap_err().key, "broker.consumer_timeout");
        Ok(())
    });
}

#[test]
fn relay_listen_url_is_one_url_or_one_per_shard() {
    Jail::expect_with(|jail| {
        let shards = "[database]\nshards = [\"postgres://h/a\", \"postgres://h/b\"]\n";
        let refused = [
            "[relay]\nlisten_url = \"not a url\"".to_string(),
            "[relay]\nlisten_url = [\"postgres://h/a\", \"postgres://h/b\"]".to_string(),
            format!("{shards}[relay]\nlisten_url = \"postgres://h/a\""),
            format!("{shards}[relay]\nlisten_url = [\"postgres://h/a\"]"),
            "[relay]\nlisten_url = \"postgres://h/a?sslmode=bogus\"".to_string(),
        ];
        for text in refused {
            jail.create_file("lapse.toml", &text)?;
            let err = load().unwrap_err();
            assert_eq!(err.key, "relay.listen_url", "{text}");
        }
        jail.create_file(
            "lapse.toml",
            &format!("{shards}[relay]\nlisten_url = [\"postgres://d/a\", \"postgres://d/b\"]"),
        )?;
        let config = load().unwrap();
        let shard = &config.database.shard_list()[1];
        let url = crate::config::listen_url(config.relay.listen_url.as_ref(), shard);
        assert_eq!(url.expose(), "postgres://d/b");
        jail.create_file("lapse.toml", "[relay]\nlisten_url = \"postgres://d/x\"")?;
        let config = load().unwrap();
        let shard = &config.database.shard_list()[0];
        let url = crate::config::listen_url(config.relay.listen_url.as_ref(), shard);
        assert_eq!(url.expose(), "postgres://d/x");
        jail.set_env("LAPSE_RELAY__LISTEN_URL", "postgres://env/y");
        let config = load().unwrap();
        let url = crate::config::listen_url(config.relay.listen_url.as_ref(), shard);
        assert_eq!(url.expose(), "postgres://env/y");
        Ok(())
    });
}

#[test]
fn worker_metrics_listen_is_host_and_port() {
    Jail::expect_with(|jail| {
        for bad in [
            "9464",
            "localhost",
            ":9464",
            "localhost:http",
            "::1:9464",
            "h:70000",
        ] {
            jail.create_file("lapse.toml", &format!("[worker]\nmetrics_listen = {bad:?}"))?;
            let err = load().unwrap_err();
            assert_eq!(err.key, "worker.metrics_listen", "{bad}");
        }
        for good in [
            "localhost:9464",
            "127.0.0.1:9464",
            "[::1]:9464",
            "0.0.0.0:9464",
        ] {
            jail.create_file(
                "lapse.toml",
                &format!("[worker]\nmetrics_listen = {good:?}"),
            )?;
            assert_eq!(load().unwrap().worker.metrics_listen.as_deref(), Some(good));
        }
        Ok(())
    });
}

#[test]
fn retention_takes_durations_or_forever_and_names_the_key() {
    Jail::expect_with(|jail| {
        jail.create_file(
            "lapse.toml",
            "[retention]\ntimeline = \"7d\"\nledger = \"forever\"\nlate_payments = \"2years\"\nbatch_size = 50",
        )?;
        let retention = load().unwrap().retention;
        assert_eq!(
            retention.timeline,
            Keep::For(Duration::from_secs(7 * 86_400))
        );
        assert_eq!(retention.ledger, Keep::Forever);
        assert_eq!(retention.batch_size, 50);
        assert_eq!(retention.timeline.millis(), Some(7 * 86_400 * 1000));
        assert_eq!(retention.ledger.millis(), None);
        for (body, key) in [
            ("timeline = \"soon\"", "retention.timeline"),
            ("ledger = \"10m\"", "retention.ledger"),
            ("late_payments = \"1000years\"", "retention.late_payments"),
            ("batch_size = 0", "retention.batch_size"),
            ("batch_size = -5", "retention.batch_size"),
        ] {
            jail.create_file("lapse.toml", &format!("[retention]\n{body}"))?;
            let err = load().unwrap_err();
            assert_eq!(err.key, key, "{body}: {err:?}");
        }
        // Absent: the defaults.
        jail.create_file("lapse.toml", "")?;
        let retention = load().unwrap().retention;
        assert_eq!(
            retention.timeline,
            Keep::For(Duration::from_secs(30 * 86_400))
        );
        Ok(())
    });
}
