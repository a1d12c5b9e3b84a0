//! Stamps the build with the commit it was made from (`lapse --version`, the
//! `lapse_build_info` metric): `BUILD_GIT_COMMIT` (not a `LAPSE_` name: cargo also sets
//! it for the test processes, which pass `LAPSE_` variables on to the lapse processes
//! they start), the first 12 hex digits of `HEAD`, or
//! `unknown` outside a git checkout (a source tarball, a container build without
//! `.git`). A tree with uncommitted changes is not marked. A build without `.git` (the
//! container's) may name its commit in the environment variable `BUILD_GIT_COMMIT`
//! (a checkout's `HEAD` wins over it).

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=BUILD_GIT_COMMIT");
    let given = std::env::var("BUILD_GIT_COMMIT")
        .ok()
        .map(|text| text.trim().to_string())
        .filter(|text| text != "unknown" && commit_like(text));
    let commit = head().or(given).unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=BUILD_GIT_COMMIT={commit}");

    // Again when HEAD moves: a new commit on the branch, or another branch.
    if let Ok(out) = Command::new("git")
        .args(["rev-parse", "--git-dir"])
        .output()
        && out.status.success()
        && let Ok(dir) = String::from_utf8(out.stdout)
    {
        let dir = dir.trim();
        println!("cargo:rerun-if-changed={dir}/HEAD");
        if let Ok(head) = std::fs::read_to_string(format!("{dir}/HEAD"))
            && let Some(reference) = head.trim().strip_prefix("ref: ")
        {
            println!("cargo:rerun-if-changed={dir}/{reference}");
        }
        println!("cargo:rerun-if-changed={dir}/packed-refs");
    }
    println!("cargo:rerun-if-changed=build.rs");
}

/// The first 12 hex digits of `HEAD`, where this is a git checkout.
fn head() -> Option<String> {
    Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|text| text.trim().to_string())
        .filter(|text| commit_like(text))
}

fn commit_like(text: &str) -> bool {
    (7..=40).contains(&text.len()) && text.chars().all(|c| c.is_ascii_hexdigit())
}
