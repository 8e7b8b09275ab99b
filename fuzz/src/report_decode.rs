//! `proxypool-controller`'s `ReportRuntime` decoder on arbitrary bytes, against its reference.
//!
//! Input: the first byte is `maxRuntimeCounters` (0–255), the rest a `ReportRuntimeRequest`
//! as it would arrive in a gRPC message. Properties:
//! - it never panics;
//! - the decoder agrees with prost's decode followed by the service's counter builder
//!   (`decode_reference`): both give the same command, counters and all, or both refuse;
//! - a refusal's message names no input byte (the messages are fixed texts);
//! - accepted counters parse back to themselves from their canonical bytes;
//! - the canonical bytes are at most twice the input, plus a line: memory follows the input.

use proxypool_controller::domain::Counters;
use proxypool_controller::grpc::report::{decode, decode_reference};

/// Longest error message the decoder writes.
const MAX_ERROR_LEN: usize = 80;

/// One input.
pub fn run(data: &[u8]) {
    let Some((&max, message)) = data.split_first() else {
        return;
    };
    let max = usize::from(max);
    let ours = decode(message, max);
    let reference = decode_reference(message, max);
    match (&ours, &reference) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "decoders disagree on {message:02x?}"),
        (Err(e), Err(_)) => {
            assert!(e.to_string().len() <= MAX_ERROR_LEN, "{e}");
        }
        _ => panic!(
            "decoders disagree on {message:02x?}: ours {:?}, prost {:?}",
            ours.as_ref().map(|_| ()),
            reference.as_ref().map(|_| ())
        ),
    }
    if let Ok(cmd) = ours
        && let Ok(counters) = cmd.counters
    {
        assert_eq!(
            Counters::from_canonical(counters.canonical()).as_ref(),
            Some(&counters)
        );
        assert!(counters.canonical().len() <= 2 * message.len() + 64);
    }
}
