//! Errors of the wire conversions and the frame codec.
//!
//! Every error names a field or a rule, never a received value: a frame may carry a credential
//! lease, a header or a body, and none of that may end up in a log line.

use crate::validate::StallTimeoutError;

/// A frame decoded as protobuf but is not a valid message of this protocol.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMessage {
    /// The bytes are not a valid protobuf encoding of the envelope.
    #[error("malformed protobuf: {0}")]
    Protobuf(#[from] prost::DecodeError),
    /// The envelope carried no message (an unknown oneof case from a newer peer counts too).
    #[error("envelope carries no known message")]
    EmptyEnvelope,
    /// A required field was absent or empty.
    #[error("missing required field `{0}`")]
    MissingField(&'static str),
    /// A field exceeded its documented length limit.
    #[error("field `{0}` is too long")]
    TooLong(&'static str),
    /// A field contained characters its syntax does not allow.
    #[error("field `{0}` contains invalid characters")]
    InvalidCharacters(&'static str),
    /// An enum field carried a value this version does not know, or `UNSPECIFIED`.
    #[error("field `{0}` has an unknown or unspecified enum value")]
    UnknownEnum(&'static str),
    /// A field's value is outside its documented range or set.
    #[error("field `{field}` is invalid: {rule}")]
    InvalidValue {
        /// The field.
        field: &'static str,
        /// The rule it broke (static text).
        rule: &'static str,
    },
    /// `response_stall_timeout_ms` was negative or overflowed.
    #[error(transparent)]
    StallTimeout(#[from] StallTimeoutError),
    /// A stream message (run or tunnel) arrived with `stream_id == 0`, or a connection-level
    /// message with a non-zero one.
    #[error("stream id is {0}")]
    StreamId(&'static str),
}

/// Why bytes on the socket could not be turned into a frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The length prefix declares a frame larger than the configured maximum. Detected from the
    /// four header bytes alone; nothing of the declared size is reserved. The connection cannot
    /// be resynchronised and must be closed.
    #[error("frame of {declared} bytes exceeds the {max}-byte limit")]
    TooLarge {
        /// The length the prefix declared.
        declared: u64,
        /// The configured maximum.
        max: usize,
    },
    /// A message to send encodes larger than the configured maximum.
    #[error("outgoing message of {len} bytes exceeds the {max}-byte limit")]
    OutgoingTooLarge {
        /// The encoded length.
        len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// The frame's bytes are not a valid message.
    #[error(transparent)]
    Invalid(#[from] InvalidMessage),
}

/// A stable code for an error that leaves the process (a close reason, a metric label).
///
/// Built from the error with `From<&FrameError>`; the set of codes is closed and short, so it
/// is safe as a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WireErrorCode(&'static str);

impl WireErrorCode {
    /// A frame exceeded the size limit.
    pub const FRAME_TOO_LARGE: Self = Self("frame_too_large");
    /// A frame did not decode or validate.
    pub const INVALID_MESSAGE: Self = Self("invalid_message");
    /// The peer broke the protocol's ordering rules.
    pub const PROTOCOL_VIOLATION: Self = Self("protocol_violation");

    /// The code as text.
    pub fn as_str(self) -> &'static str {
        self.0
    }
}

impl std::fmt::Display for WireErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl From<&FrameError> for WireErrorCode {
    fn from(e: &FrameError) -> Self {
        match e {
            FrameError::TooLarge { .. } | FrameError::OutgoingTooLarge { .. } => {
                Self::FRAME_TOO_LARGE
            }
            FrameError::Invalid(_) => Self::INVALID_MESSAGE,
        }
    }
}
