//! Field validation shared by every wire conversion.
//!
//! Conversion from the generated protobuf types into this crate's domain types is where
//! validation happens ("parse, don't validate"): a domain value that exists is valid. The
//! rules below are this crate's choices where the seeds are silent; each is documented on the
//! function that applies it.

use std::time::Duration;

use crate::error::InvalidMessage;

/// Longest identifier (node id, run id, adapter instance name, principal/slot/route id) in bytes.
pub const MAX_ID_LEN: usize = 128;
/// Longest provider target (upstream model name) in bytes.
pub const MAX_TARGET_LEN: usize = 256;
/// Longest free-text reason or legacy error string in bytes.
pub const MAX_TEXT_LEN: usize = 4096;

/// The largest index at most `max` that is a character boundary of `text` (`text.len()` when
/// it is shorter): where to cut it so that the first part is at most `max` bytes. Never 0 for
/// `max >= 4`, a character being at most 4 bytes. (`str::floor_char_boundary` needs Rust 1.91;
/// the MSRV is 1.89.)
pub fn floor_char_boundary(text: &str, max: usize) -> usize {
    if text.len() <= max {
        return text.len();
    }
    (max.saturating_sub(3)..=max)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0)
}

/// The Node's default response-stall timeout, applied when the wire carries zero (seed 000).
pub const DEFAULT_RESPONSE_STALL_TIMEOUT: Duration = Duration::from_millis(300_000);

/// Largest accepted `response_stall_timeout_ms`: the largest millisecond count whose nanosecond
/// value still fits an `i64` (the reference implementation's duration type). Anything larger is
/// the seed's "overflow" and is rejected.
pub const MAX_RESPONSE_STALL_TIMEOUT_MS: i64 = i64::MAX / 1_000_000;

/// A validated `response_stall_timeout_ms`.
///
/// The wire value zero means "use the Node default" and is kept apart from an explicit
/// `300000`, so that re-encoding gives back what was received.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ResponseStallTimeout {
    explicit_ms: Option<u64>,
}

impl ResponseStallTimeout {
    /// The Node default ([`DEFAULT_RESPONSE_STALL_TIMEOUT`]); what direct, non-pool calls send.
    pub const DEFAULT: Self = Self { explicit_ms: None };

    /// Validates the wire value: `0` → default, negative or overflowing → error.
    pub fn from_wire_ms(ms: i64) -> Result<Self, StallTimeoutError> {
        match ms {
            0 => Ok(Self::DEFAULT),
            ms if ms < 0 => Err(StallTimeoutError::Negative),
            ms if ms > MAX_RESPONSE_STALL_TIMEOUT_MS => Err(StallTimeoutError::Overflow),
            // `ms` is positive here, so the conversion cannot fail.
            ms => Ok(Self {
                explicit_ms: Some(ms.unsigned_abs()),
            }),
        }
    }

    /// An explicit timeout (what the Edge copies from the winning provider candidate).
    ///
    /// A zero duration means the default, as on the wire. Durations above
    /// [`MAX_RESPONSE_STALL_TIMEOUT_MS`] are an error.
    pub fn from_duration(timeout: Duration) -> Result<Self, StallTimeoutError> {
        let ms = i64::try_from(timeout.as_millis()).map_err(|_| StallTimeoutError::Overflow)?;
        Self::from_wire_ms(ms)
    }

    /// The value that goes on the wire.
    pub fn to_wire_ms(self) -> i64 {
        // Bounded by MAX_RESPONSE_STALL_TIMEOUT_MS at construction.
        self.explicit_ms
            .map_or(0, |ms| i64::try_from(ms).unwrap_or(i64::MAX))
    }

    /// The timeout the Node applies.
    pub fn effective(self) -> Duration {
        self.explicit_ms
            .map_or(DEFAULT_RESPONSE_STALL_TIMEOUT, Duration::from_millis)
    }

    /// Whether the wire carried zero (the Node default applies).
    pub fn is_default(self) -> bool {
        self.explicit_ms.is_none()
    }
}

/// Why a `response_stall_timeout_ms` was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StallTimeoutError {
    /// The value was below zero.
    #[error("response_stall_timeout_ms is negative")]
    Negative,
    /// The value was above [`MAX_RESPONSE_STALL_TIMEOUT_MS`].
    #[error("response_stall_timeout_ms overflows")]
    Overflow,
}

/// Checks an identifier: 1..=[`MAX_ID_LEN`] bytes of `A-Z a-z 0-9 . _ - :`.
///
/// Node ids additionally have to be valid SPIFFE path segments (no `:`), because the Node's
/// workload certificate names it; see [`node_id`].
pub(crate) fn id(field: &'static str, value: &str) -> Result<(), InvalidMessage> {
    if value.is_empty() {
        return Err(InvalidMessage::MissingField(field));
    }
    if value.len() > MAX_ID_LEN {
        return Err(InvalidMessage::TooLong(field));
    }
    // One table lookup per byte, no early exit: ids are short, and a branch-free pass over
    // them is about twice as fast as the per-byte range checks (the codec bench's `run_request`
    // validates three per frame).
    if !value
        .bytes()
        .fold(true, |ok, b| ok & ID_BYTES[usize::from(b)])
    {
        return Err(InvalidMessage::InvalidCharacters(field));
    }
    Ok(())
}

/// The bytes [`id`] allows.
static ID_BYTES: [bool; 256] = {
    let mut t = [false; 256];
    let mut i = 0;
    while i < 256 {
        #[expect(clippy::cast_possible_truncation, reason = "i < 256")]
        let b = i as u8;
        t[i] = b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':');
        i += 1;
    }
    t
};

/// As [`id`], but an empty value is allowed (it has a documented meaning, e.g. the legacy
/// single adapter instance).
pub(crate) fn optional_id(field: &'static str, value: &str) -> Result<(), InvalidMessage> {
    if value.is_empty() {
        Ok(())
    } else {
        id(field, value)
    }
}

/// A Node id: 1..=[`MAX_ID_LEN`] bytes of `A-Z a-z 0-9 . _ -`, not `.` or `..` (a SPIFFE path
/// segment, so it can be the name in the Node's workload certificate).
pub(crate) fn node_id(field: &'static str, value: &str) -> Result<(), InvalidMessage> {
    id(field, value)?;
    if value.contains(':') || value == "." || value == ".." {
        return Err(InvalidMessage::InvalidCharacters(field));
    }
    Ok(())
}

/// A provider target: 1..=[`MAX_TARGET_LEN`] bytes of visible ASCII (`!`..=`~`), so names such as
/// `meta-llama/Llama-3-8B` or `llama3.1:8b` pass and whitespace or control bytes do not.
pub(crate) fn target(field: &'static str, value: &str) -> Result<(), InvalidMessage> {
    if value.is_empty() {
        return Err(InvalidMessage::MissingField(field));
    }
    optional_target(field, value)
}

/// As [`target`], but empty is allowed ("all targets").
pub(crate) fn optional_target(field: &'static str, value: &str) -> Result<(), InvalidMessage> {
    if value.len() > MAX_TARGET_LEN {
        return Err(InvalidMessage::TooLong(field));
    }
    if !value.bytes().fold(true, |ok, b| ok & b.is_ascii_graphic()) {
        return Err(InvalidMessage::InvalidCharacters(field));
    }
    Ok(())
}

/// Free text (reasons, legacy error strings): at most [`MAX_TEXT_LEN`] bytes.
pub(crate) fn text(field: &'static str, value: &str) -> Result<(), InvalidMessage> {
    if value.len() > MAX_TEXT_LEN {
        return Err(InvalidMessage::TooLong(field));
    }
    Ok(())
}

/// An HTTP header name: an RFC 9110 token, at most 256 bytes.
pub(crate) fn header_name(value: &str) -> Result<(), InvalidMessage> {
    const FIELD: &str = "header.name";
    if value.is_empty() {
        return Err(InvalidMessage::MissingField(FIELD));
    }
    if value.len() > 256 {
        return Err(InvalidMessage::TooLong(FIELD));
    }
    let tchar = |b: u8| {
        b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'!' | b'#'
                    | b'$'
                    | b'%'
                    | b'&'
                    | b'\''
                    | b'*'
                    | b'+'
                    | b'-'
                    | b'.'
                    | b'^'
                    | b'_'
                    | b'`'
                    | b'|'
                    | b'~'
            )
    };
    if !value.bytes().all(tchar) {
        return Err(InvalidMessage::InvalidCharacters(FIELD));
    }
    Ok(())
}

/// An HTTP header value: no CR, LF or NUL (no header injection through the tunnel), at most
/// 16 KiB.
pub(crate) fn header_value(value: &[u8]) -> Result<(), InvalidMessage> {
    const FIELD: &str = "header.value";
    if value.len() > 16 * 1024 {
        return Err(InvalidMessage::TooLong(FIELD));
    }
    if value.iter().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
        return Err(InvalidMessage::InvalidCharacters(FIELD));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stall_timeout_zero_is_default_and_round_trips() {
        let t = ResponseStallTimeout::from_wire_ms(0).unwrap();
        assert!(t.is_default());
        assert_eq!(t.effective(), Duration::from_millis(300_000));
        assert_eq!(t.to_wire_ms(), 0);
    }

    #[test]
    fn stall_timeout_explicit_values() {
        let t = ResponseStallTimeout::from_wire_ms(1).unwrap();
        assert_eq!(t.effective(), Duration::from_millis(1));
        assert_eq!(t.to_wire_ms(), 1);
        let t = ResponseStallTimeout::from_wire_ms(300_000).unwrap();
        assert!(!t.is_default());
        assert_eq!(t.to_wire_ms(), 300_000);
    }

    #[test]
    fn stall_timeout_rejects_negative_and_overflow_at_the_boundary() {
        assert_eq!(
            ResponseStallTimeout::from_wire_ms(-1),
            Err(StallTimeoutError::Negative)
        );
        assert_eq!(
            ResponseStallTimeout::from_wire_ms(i64::MIN),
            Err(StallTimeoutError::Negative)
        );
        let max = MAX_RESPONSE_STALL_TIMEOUT_MS;
        assert!(ResponseStallTimeout::from_wire_ms(max - 1).is_ok());
        assert_eq!(
            ResponseStallTimeout::from_wire_ms(max)
                .unwrap()
                .to_wire_ms(),
            max
        );
        assert_eq!(
            ResponseStallTimeout::from_wire_ms(max + 1),
            Err(StallTimeoutError::Overflow)
        );
        assert_eq!(
            ResponseStallTimeout::from_wire_ms(i64::MAX),
            Err(StallTimeoutError::Overflow)
        );
        assert_eq!(
            ResponseStallTimeout::from_duration(Duration::MAX),
            Err(StallTimeoutError::Overflow)
        );
    }

    #[test]
    fn ids() {
        assert!(id("f", "node-1.a_b:c").is_ok());
        assert_eq!(id("f", ""), Err(InvalidMessage::MissingField("f")));
        assert_eq!(id("f", &"a".repeat(MAX_ID_LEN)), Ok(()));
        assert_eq!(
            id("f", &"a".repeat(MAX_ID_LEN + 1)),
            Err(InvalidMessage::TooLong("f"))
        );
        assert_eq!(id("f", "a b"), Err(InvalidMessage::InvalidCharacters("f")));
        assert_eq!(
            node_id("f", "n:1"),
            Err(InvalidMessage::InvalidCharacters("f"))
        );
        assert_eq!(
            node_id("f", ".."),
            Err(InvalidMessage::InvalidCharacters("f"))
        );
        assert!(optional_id("f", "").is_ok());
        assert!(target("f", "meta-llama/Llama-3-8B").is_ok());
        assert!(target("f", "llama 3").is_err());
    }

    #[test]
    fn headers() {
        assert!(header_name("x-api-key").is_ok());
        assert!(header_name("bad header").is_err());
        assert!(header_name("").is_err());
        assert!(header_value(b"Bearer abc").is_ok());
        assert!(header_value(b"a\r\nInjected: 1").is_err());
    }
}
