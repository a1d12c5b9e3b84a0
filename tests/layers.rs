//! The layering rules of docs/architecture.md ("Layers"), checked on the source tree:
//! lower layers never name higher ones, not even in a doc link. The same checks as the
//! `grep` lines there, so the document and the code cannot drift apart.

use std::path::{Path, PathBuf};

/// The domain and shared ground.
const DOMAIN: &[&str] = &[
    "src/config",
    "src/tier.rs",
    "src/tier_file.rs",
    "src/names.rs",
    "src/message.rs",
    "src/close",
    "src/orders.rs",
    "src/deadline.rs",
    "src/timeline.rs",
    "src/db",
    "src/redact.rs",
    "src/tls.rs",
    "src/pack.rs",
    "src/kinds",
];

/// Every `.rs` file under `roots` (files or directories, relative to the crate).
fn sources(roots: &[&str]) -> Vec<PathBuf> {
    fn walk(path: &Path, found: &mut Vec<PathBuf>) {
        if path.is_dir() {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
                .map(|e| e.unwrap().path())
                .collect();
            entries.sort();
            for entry in entries {
                walk(&entry, found);
            }
        } else if path.extension().is_some_and(|x| x == "rs") {
            found.push(path.to_path_buf());
        }
    }
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for root in roots {
        let path = crate_dir.join(root);
        assert!(
            path.exists(),
            "{root} is gone: update the layers here and in docs/architecture.md"
        );
        walk(&path, &mut found);
    }
    found
}

/// Each line of `files` that names `crate::<module>` for one of `modules` (a whole
/// path segment: `crate::tls` is not `crate::tls_files`), as `path:line: text`; a
/// group (`use crate::{a::b, c}`) names each of its items, at the line it opens.
fn naming(files: &[PathBuf], modules: &[&str]) -> Vec<String> {
    let mut hits = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(file).unwrap();
        let mut start = 0;
        for (n, raw) in text.split_inclusive('\n').enumerate() {
            let line = raw.trim_end_matches(['\n', '\r']);
            let mut paths: Vec<String> = Vec::new();
            for (at, _) in line.match_indices("crate::") {
                let rest = &line[at + "crate::".len()..];
                match rest.strip_prefix('{') {
                    Some(_) => paths.extend(group_items(&text[start + at + "crate::{".len()..])),
                    None => paths.push(rest.to_string()),
                }
            }
            start += raw.len();
            let names = paths.iter().any(|path| {
                modules.iter().any(|m| {
                    path.strip_prefix(m).is_some_and(|after| {
                        !after.starts_with(|c: char| c.is_alphanumeric() || c == '_')
                    })
                })
            });
            if names {
                hits.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
            }
        }
    }
    hits
}

/// The items of a `{...}` group whose text starts right after its `{`, each as the
/// path it names (nested groups flattened: `a::{b, c}` gives `a::b`, `a::c`).
fn group_items(text: &str) -> Vec<String> {
    let (mut items, mut current, mut depth) = (Vec::new(), String::new(), 0);
    let mut in_comment = false;
    for c in text.chars() {
        // A line comment inside the group says nothing about its items.
        if in_comment {
            in_comment = c != '\n';
            continue;
        }
        if c == '/' && current.ends_with('/') {
            current.pop();
            in_comment = true;
            continue;
        }
        match c {
            '{' => {
                depth += 1;
                current.push(c);
            }
            '}' if depth == 0 => break,
            '}' => {
                depth -= 1;
                current.push(c);
            }
            ',' if depth == 0 => items.push(std::mem::take(&mut current)),
            _ => current.push(c),
        }
    }
    items.push(current);
    items
        .iter()
        // `a::b as c` names `a::b`.
        .map(|item| {
            let item = item.split(" as ").next().unwrap_or_default();
            item.split_whitespace().collect::<String>()
        })
        .filter(|item| !item.is_empty())
        .flat_map(|item| match item.split_once("::{") {
            Some((head, inner)) => group_items(inner)
                .into_iter()
                .map(|tail| format!("{head}::{tail}"))
                .collect(),
            None => vec![item],
        })
        .collect()
}

#[test]
fn the_domain_and_the_adapters_name_no_component_command_or_service() {
    let mut files = sources(DOMAIN);
    files.extend(sources(&["src/amqp"]));
    let hits = naming(&files, &["components", "cli", "service"]);
    assert!(hits.is_empty(), "{hits:#?}");
}

#[test]
fn the_domain_names_no_broker_adapter() {
    let hits = naming(&sources(DOMAIN), &["amqp"]);
    assert!(hits.is_empty(), "{hits:#?}");
}

#[test]
fn components_name_no_command_or_service() {
    let hits = naming(&sources(&["src/components"]), &["cli", "service"]);
    assert!(hits.is_empty(), "{hits:#?}");
}

#[test]
fn the_plumbing_names_no_component_service_or_command() {
    let files = sources(&["src/runtime", "src/observe"]);
    let hits = naming(&files, &["components", "service", "cli"]);
    assert!(hits.is_empty(), "{hits:#?}");
}

#[test]
fn the_check_sees_a_name_and_only_a_whole_one() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sample.rs");
    std::fs::write(
        &file,
        "use crate::amqp::tls_files;\n// crate::tls_files \u{2014} a dash\nuse crate::tls;\n\
         use crate::{\n    names::Names, // crate::x, tls\n    db::{self, tls::X},\n};\n\
         use crate::{tlsx, y};\nuse crate::{service as s, cli};\n",
    )
    .unwrap();
    let hits = naming(std::slice::from_ref(&file), &["tls"]);
    assert_eq!(hits.len(), 1, "{hits:#?}");
    assert!(hits[0].ends_with(":3: use crate::tls;"), "{hits:#?}");
    let hits = naming(std::slice::from_ref(&file), &["db::tls"]);
    assert_eq!(hits.len(), 1, "{hits:#?}");
    assert!(hits[0].ends_with(":4: use crate::{"), "{hits:#?}");
    assert_eq!(naming(std::slice::from_ref(&file), &["names"]).len(), 1);
    assert_eq!(naming(std::slice::from_ref(&file), &["service"]).len(), 1);
    // The same with Windows line ends: the same lines.
    let crlf = dir.path().join("crlf.rs");
    let text = std::fs::read_to_string(&file)
        .unwrap()
        .replace('\n', "\r\n");
    std::fs::write(&crlf, text).unwrap();
    let hits = naming(&[crlf], &["db::tls", "service"]);
    assert_eq!(hits.len(), 2, "{hits:#?}");
    assert!(hits[0].ends_with(":4: use crate::{"), "{hits:#?}");
}
