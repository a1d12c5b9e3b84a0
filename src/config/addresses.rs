//! `broker.url` may name several broker nodes: AMQP URLs separated by commas
//! (a comma inside a password is written `%2C`). Splitting and joining the list is
//! plain text work, shared by validation, readiness and the broker adapter (which
//! tries the addresses in order, see `amqp::broker`).

use super::Secret;

/// The addresses of a `broker.url` value, in order, without surrounding spaces.
/// Empty entries are kept (as empty strings) so that validation can name them.
pub fn split_addresses(list: &Secret) -> Vec<Secret> {
    list.expose()
        .split(',')
        .map(|s| Secret::new(s.trim()))
        .collect()
}

/// Joins addresses back into one `broker.url` value.
pub fn join_addresses(addresses: &[Secret]) -> Secret {
    Secret::new(
        addresses
            .iter()
            .map(Secret::expose)
            .collect::<Vec<_>>()
            .join(","),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_trims_and_keeps_empty_entries() {
        let list = Secret::new("amqp://a:1/%2f, amqp://b:2/%2f,,");
        let parts: Vec<String> = split_addresses(&list)
            .iter()
            .map(|s| s.expose().into())
            .collect();
        assert_eq!(parts, ["amqp://a:1/%2f", "amqp://b:2/%2f", "", ""]);
        assert_eq!(split_addresses(&Secret::new("amqp://a")).len(), 1);
    }
}
