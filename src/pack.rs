//! Packs: many timeouts in one broker message (docs/pipeline.md, "Packs").
//!
//! A pack's body is `{"v": 3, "entries": [...]}`, each entry a one-deadline timeout
//! exactly as a single message carries it (version 1 for an order, 2 for a kind's
//! deadline). A pack of one is never written: one deadline travels as the message it
//! always was, so a worker of an earlier version still reads it.
//!
//! Invariants: a pack goes where its earliest entry's plan sends it, and every entry
//! of it would have been sent there alone (the relay and the worker pack only
//! entries whose next route is the same), so no entry arrives earlier than alone. An
//! entry is decoded on its own: one that cannot be is parked alone, as its own body,
//! and the others go on.

use lapin::BasicProperties;
use lapin::types::ShortString;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::config::MAX_PACK_ENTRIES;
use crate::message::{DecodeError, TimeoutMessage};

/// The body version of a pack.
pub const PACK_VERSION: u32 = 3;

/// One entry of a delivery: the body it would have as a message of its own (what is
/// parked for it, what a held remainder is re-packed from) and what it decodes to.
#[derive(Clone, Debug)]
pub struct Entry {
    pub body: Vec<u8>,
    pub message: Result<TimeoutMessage, DecodeError>,
}

impl Entry {
    pub fn of(message: TimeoutMessage) -> Self {
        Self {
            body: message.encode(),
            message: Ok(message),
        }
    }
}

#[derive(Deserialize)]
struct PackBody<'a> {
    v: u64,
    #[serde(borrow)]
    entries: Vec<&'a RawValue>,
}

#[derive(Deserialize)]
struct VersionOnly {
    v: u64,
}

/// The entries of a delivery's body: a pack's, each decoded alone, or the body itself
/// as one entry (a single message, or something that is no timeout at all: one entry
/// that fails to decode, parked with the reason).
pub fn unpack(body: &[u8]) -> Vec<Entry> {
    let single = || {
        vec![Entry {
            body: body.to_vec(),
            message: TimeoutMessage::decode(body),
        }]
    };
    if !is_pack(body) {
        return single();
    }
    match serde_json::from_slice::<PackBody>(body) {
        Ok(pack) if pack.entries.len() > MAX_PACK_ENTRIES => vec![Entry {
            body: body.to_vec(),
            message: Err(DecodeError::Malformed(format!(
                "a pack of {} entries, more than the {MAX_PACK_ENTRIES} a pack may carry",
                pack.entries.len()
            ))),
        }],
        Ok(pack) if pack.v == u64::from(PACK_VERSION) && !pack.entries.is_empty() => pack
            .entries
            .into_iter()
            .map(|raw| Entry {
                body: raw.get().as_bytes().to_vec(),
                message: TimeoutMessage::decode(raw.get().as_bytes()),
            })
            .collect(),
        Ok(_) => vec![Entry {
            body: body.to_vec(),
            message: Err(DecodeError::Malformed("a pack without entries".into())),
        }],
        Err(e) => vec![Entry {
            body: body.to_vec(),
            message: Err(DecodeError::Malformed(format!(
                "a pack that is not one: {e}"
            ))),
        }],
    }
}

fn is_pack(body: &[u8]) -> bool {
    serde_json::from_slice::<VersionOnly>(body).is_ok_and(|v| v.v == u64::from(PACK_VERSION))
}

/// The body carrying `entries`: the one entry's own body, or a pack of them (each
/// entry's body as it is, so an entry nobody could decode travels unchanged).
pub fn body(entries: &[&[u8]]) -> Vec<u8> {
    // A lone entry travels as itself, unless it would read as a pack (a hostile
    // entry that is one): then it stays wrapped, and is parked as what it is.
    if let [one] = entries
        && !is_pack(one)
    {
        return one.to_vec();
    }
    let size = entries.iter().map(|e| e.len() + 1).sum::<usize>() + 24;
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(format!("{{\"v\":{PACK_VERSION},\"entries\":[").as_bytes());
    for (i, e) in entries.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(e);
    }
    out.extend_from_slice(b"]}");
    out
}

/// The body and properties of a message carrying `messages` (at least one).
pub fn encode(messages: &[TimeoutMessage]) -> (Vec<u8>, BasicProperties) {
    let bodies: Vec<Vec<u8>> = messages.iter().map(TimeoutMessage::encode).collect();
    let refs: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
    let carried: Vec<&TimeoutMessage> = messages.iter().collect();
    (body(&refs), properties(&carried))
}

/// The properties of a message carrying `messages` (at least one): a single
/// message's own, or a pack's, whose id names its first entry and its size.
pub fn properties(messages: &[&TimeoutMessage]) -> BasicProperties {
    let first = messages[0].properties();
    match messages.len() {
        1 => first,
        n => {
            let id = format!("pack-{}-n{n}", messages[0].message_id());
            first.with_message_id(ShortString::from(id))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{DateTime, Utc};

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn a_pack_carries_each_entry_as_its_own_message_and_one_entry_is_no_pack() {
        let a = TimeoutMessage::new(1, at("2026-12-07T10:00:00.100Z"), 1);
        let b = TimeoutMessage::for_deadline(7, "auto_confirm", "SO-1", a.expire_at, 2).in_shard(1);
        let (ea, eb) = (a.encode(), b.encode());
        let one = body(&[&ea]);
        assert_eq!(one, ea, "a single deadline travels as it always did");
        let two = body(&[&ea, &eb]);
        let text = String::from_utf8(two.clone()).unwrap();
        assert!(text.starts_with(r#"{"v":3,"entries":[{"v":1,"#), "{text}");
        let entries = unpack(&two);
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].message.as_ref().unwrap(), &a);
        assert_eq!(entries[1].message.as_ref().unwrap(), &b);
        assert_eq!(entries[1].body, eb);
        assert_eq!(
            properties(&[&a, &b])
                .message_id()
                .as_ref()
                .unwrap()
                .as_str(),
            "pack-order-1-v1-n2"
        );
        assert_eq!(properties(&[&a]).message_id(), a.properties().message_id());
    }

    #[test]
    fn a_bad_entry_fails_alone_and_a_bad_pack_is_one_bad_entry() {
        let good = TimeoutMessage::new(1, at("2026-12-07T10:00:00.100Z"), 1).encode();
        let bad = br#"{"v":1,"order_id":"x"}"#;
        let future = br#"{"v":9}"#;
        let pack = body(&[&good, bad, future, &good]);
        let entries = unpack(&pack);
        assert_eq!(entries.len(), 4);
        assert!(entries[0].message.is_ok() && entries[3].message.is_ok());
        assert!(matches!(entries[1].message, Err(DecodeError::Malformed(_))));
        assert_eq!(entries[1].body, bad.to_vec(), "parked as it came");
        assert_eq!(entries[2].message, Err(DecodeError::UnknownVersion(9)));
        for hostile in [
            br#"{"v":3,"entries":[]}"#.as_slice(),
            br#"{"v":3,"entries":{}}"#,
            br#"{"v":3}"#,
            b"\xff not json",
            br#"[1,2]"#,
        ] {
            let entries = unpack(hostile);
            assert_eq!(entries.len(), 1, "{hostile:?}");
            assert!(entries[0].message.is_err(), "{hostile:?}");
            assert_eq!(entries[0].body, hostile.to_vec());
        }
    }

    #[test]
    fn a_lone_entry_that_is_a_pack_stays_wrapped_and_an_oversized_pack_is_one_bad_entry() {
        let inner = body(&[b"{}".as_slice(), b"{}".as_slice()]);
        let outer = body(&[&inner]);
        assert_ne!(outer, inner);
        let entries = unpack(&outer);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].body, inner);
        assert_eq!(entries[0].message, Err(DecodeError::UnknownVersion(3)));
        let many: Vec<&[u8]> = vec![b"{}".as_slice(); MAX_PACK_ENTRIES + 1];
        let entries = unpack(&body(&many));
        assert_eq!(entries.len(), 1);
        assert!(
            matches!(&entries[0].message, Err(DecodeError::Malformed(m)) if m.contains("more than"))
        );
    }

    #[test]
    fn ten_thousand_entries_round_trip() {
        let bodies: Vec<Vec<u8>> = (0..10_000)
            .map(|i| TimeoutMessage::new(i, at("2026-12-07T10:00:00.100Z"), 1).encode())
            .collect();
        let refs: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
        let entries = unpack(&body(&refs));
        assert_eq!(entries.len(), 10_000);
        assert!(
            entries
                .iter()
                .enumerate()
                .all(|(i, e)| e.message.as_ref().unwrap().order_id == i as i64)
        );
    }
}
