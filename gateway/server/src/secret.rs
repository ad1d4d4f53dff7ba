//! Checking the secrets clients, operators and nodes present: API keys, the trusted-client
//! token, the admin token, the cluster token. Comparisons take the same time wherever the first
//! differing byte is, so a caller guessing a key learns nothing from how fast it is refused.

/// `given == want`, in time that depends only on the lengths.
pub fn same_secret(given: &str, want: &str) -> bool {
    given.len() == want.len()
        && given
            .bytes()
            .zip(want.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// The key of an `Authorization: Bearer KEY` header value.
pub fn bearer(authorization: Option<&str>) -> Option<&str> {
    authorization?.strip_prefix("Bearer ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_secrets_only() {
        assert!(same_secret("k-123", "k-123"));
        assert!(!same_secret("k-123", "k-124"));
        assert!(!same_secret("k-12", "k-123"));
        assert!(!same_secret("", "k"));
        assert!(same_secret("", ""));
        assert_eq!(bearer(Some("Bearer abc")), Some("abc"));
        assert_eq!(bearer(Some("Basic abc")), None);
        assert_eq!(bearer(None), None);
    }
}
