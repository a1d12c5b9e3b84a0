//! A shard's position in `database.shards` never changes: timeout messages name their
//! shard by it. The first migration records each database's position; a reordered
//! list is refused by `lapse migrate` and by a worker's start (with or without
//! `worker.migrate_on_start`), naming the shard, before anything is read or closed.
//! Growing the list at the end is fine.

use super::Databases;
use crate::helpers::{TestEnv, exit_of, spawn_worker, stderr, stdout};

fn shards(urls: &[&String]) -> String {
    let quoted: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
    format!("[database]\nshards = [{}]\n", quoted.join(", "))
}

/// `lapse migrate` with `database` as the configuration's `[database]` section: its
/// exit status, and what it printed (stdout, then stderr).
fn migrate(env: &TestEnv, database: &str) -> (Option<i32>, String) {
    env.write_config(database);
    let out = env.lapse(&["migrate"]);
    (
        out.status.code(),
        format!("{}{}", stdout(&out), stderr(&out)),
    )
}

/// What a refused list says: the shard, where it was first migrated, and not to
/// reorder.
fn assert_names_the_move(text: &str, key: &str, recorded: u16) {
    assert!(text.contains(key), "names {key}: {text}");
    assert!(
        text.contains(&format!("first migrated as shard {recorded}")),
        "says where it was first migrated: {text}"
    );
    assert!(text.contains("must never change"), "{text}");
}

// Over 60 lines on purpose: one list, then each way of getting it wrong, in the order an operator would meet them.
#[tokio::test]
async fn a_reordered_shard_list_is_refused_naming_the_shard() {
    let env = TestEnv::new(&["1s"]).await;
    let dbs = Databases::new(&["p0", "p1", "p2"]);
    let urls = dbs.urls();
    let (a, b, c) = (&urls[0], &urls[1], &urls[2]);

    let (code, text) = migrate(&env, &shards(&[a, b]));
    assert_eq!(code, Some(0), "{text}");

    // Swapped: `lapse migrate` refuses both, as a configuration error.
    let (code, text) = migrate(&env, &shards(&[b, a]));
    assert_eq!(code, Some(2), "{text}");
    assert_names_the_move(&text, "database.shards[0]", 1);
    assert_names_the_move(&text, "database.shards[1]", 0);

    // A worker with the swapped list does not start, whether it migrates or not.
    for migrate in ["true", "false"] {
        let child = spawn_worker(&env, &[("LAPSE_WORKER__MIGRATE_ON_START", migrate)]);
        let (code, text) = exit_of(child).await;
        assert_eq!(code, Some(2), "migrate_on_start = {migrate}: {text}");
        assert_names_the_move(&text, "database.shards[0]", 1);
    }

    // Shard 1 alone in database.url would be shard 0: refused too.
    let (code, text) = migrate(&env, &format!("[database]\nurl = {b:?}\n"));
    assert_eq!(code, Some(2), "{text}");
    assert_names_the_move(&text, "database.url", 1);

    // A database new to the list, put first by mistake: refused with the rest, and
    // nothing is migrated or recorded, so the right list works afterwards.
    let (code, text) = migrate(&env, &shards(&[c, a, b]));
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains(
            "database.shards[0]): not migrated: database.shards[1], database.shards[2] of the \
             same list are not where they were first migrated"
        ),
        "{text}"
    );
    assert_names_the_move(&text, "database.shards[1]", 0);

    // Growing the list at the end keeps every position: migrated, and a worker starts
    // on it (it is still running when stopped).
    let (code, text) = migrate(&env, &shards(&[a, b, c]));
    assert_eq!(code, Some(0), "{text}");
    let mut child = spawn_worker(&env, &[("LAPSE_WORKER__MIGRATE_ON_START", "false")]);
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    if child.try_wait().unwrap().is_some() {
        panic!(
            "a worker with the grown list stopped: {:?}",
            exit_of(child).await
        );
    }
    child.start_kill().unwrap();
    let _ = child.wait().await;

    // The third database was recorded as shard 2: moving it to the front is refused.
    env.write_config(&shards(&[c, a, b]));
    let out = env.lapse(&["migrate", "--json"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let error = json["shards"][0]["error"].as_str().unwrap_or_default();
    assert!(error.contains("first migrated as shard 2"), "{json}");

    drop(dbs);
    env.cleanup().await;
}

/// Two deployments with the same prefix share its due queue. Lists that agree at every
/// position (one a beginning of the other) are the same deployment; lists that share a
/// database but differ elsewhere ([x, y] and [x, z]) pass every position check, yet a
/// timeout of the first one's shard 1 taken by the second would be judged in z. The
/// second list is refused, by `lapse migrate` and by a worker's start, naming the
/// shard; another prefix may use it.
#[tokio::test]
async fn another_list_under_the_same_prefix_is_refused() {
    let env = TestEnv::new(&["1s"]).await;
    let dbs = Databases::new(&["l0", "l1", "l2", "l3"]);
    let urls = dbs.urls();
    let (x, y, z, w) = (&urls[0], &urls[1], &urls[2], &urls[3]);

    let (code, text) = migrate(&env, &shards(&[x, y]));
    assert_eq!(code, Some(0), "{text}");

    let (code, text) = migrate(&env, &shards(&[x, z]));
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("database.shards[0]"),
        "names the shard: {text}"
    );
    assert!(text.contains("another list of order databases"), "{text}");
    assert!(
        text.contains("database.shards[1] is another database"),
        "names the position: {text}"
    );

    // A worker with that list does not start either (without migrating: the list
    // was refused above, so z holds lapse's schema but no record of x's list).
    let child = spawn_worker(&env, &[("LAPSE_WORKER__MIGRATE_ON_START", "false")]);
    let (code, text) = exit_of(child).await;
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("another list of order databases"), "{text}");

    // The same databases under another prefix: another deployment, another queue.
    env.write_config(&shards(&[x, z]));
    let config = env.config_path();
    let other = format!("{}-b", env.prefix);
    let out = crate::helpers::run_lapse(
        &["--config", config.to_str().unwrap(), "migrate"],
        &[("LAPSE_BROKER__PREFIX", &other)],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    // Growing the first list at its end, or naming only its beginning: fine.
    let (code, text) = migrate(&env, &shards(&[x, y, w]));
    assert_eq!(code, Some(0), "{text}");
    let (code, text) = migrate(&env, &format!("[database]\nurl = {x:?}\n"));
    assert_eq!(code, Some(0), "{text}");

    drop(dbs);
    env.cleanup().await;
}
