//! Untrusted provider bytes through `iop_dialect::usage::UsageScanner` (the Node reading the
//! token usage out of a provider's response body, on the side of the bytes it tunnels to the
//! Edge untouched).
//!
//! Input: byte 0 is the size of the reads the body arrives in (1–255); byte 1's low bit says
//! whether the body is an SSE stream (1) or a JSON body (0); the rest is the body.
//!
//! Oracles: never panics; what is handed out does not depend on how the body is cut (whole, in
//! reads of the chosen size, one byte at a time for short bodies): the last figures `update`
//! handed out after a read (a stream's own end seen), and what `finish` adds at the body's end;
//! two hand-outs in a row never repeat the same figures;
//! every figure is consistent (total = input + output, cached at most the input); the scanner
//! never holds more than twice its documented bound.

use iop_dialect::usage::{MAX_BODY_SCAN, MAX_SSE_LINE, TokenUsage, UsageScanner};

/// One input.
pub fn run(data: &[u8]) {
    let [read, mode, body @ ..] = data else {
        return;
    };
    let sse = mode & 1 == 1;
    let whole = scan(body, sse, body.len().max(1));
    let parts = scan(body, sse, usize::from(*read).max(1));
    assert_eq!(whole, parts, "the usage depends on the cut");
    if body.len() <= 512 {
        assert_eq!(whole, scan(body, sse, 1), "the usage depends on the cut");
    }
}

/// For `body` fed in reads of `read` bytes: the last usage `update` handed out, and what
/// `finish` handed out.
fn scan(body: &[u8], sse: bool, read: usize) -> (Option<TokenUsage>, Option<TokenUsage>) {
    let bound = 2 * if sse { MAX_SSE_LINE } else { MAX_BODY_SCAN };
    let mut scanner = UsageScanner::new(sse);
    let mut last = None;
    for chunk in body.chunks(read) {
        scanner.feed(chunk);
        assert!(scanner.held() <= bound, "held {} bytes", scanner.held());
        if let Some(u) = scanner.update() {
            check(u);
            assert_ne!(Some(u), last, "the same figures handed out twice");
            last = Some(u);
        }
    }
    let finished = scanner.finish();
    if let Some(u) = finished {
        check(u);
        assert_ne!(Some(u), last, "finish repeated what update handed out");
    }
    (last, finished)
}

fn check(u: TokenUsage) {
    assert_eq!(
        u.total_tokens,
        u.prompt_tokens.saturating_add(u.completion_tokens)
    );
    assert!(u.cached_prompt_tokens <= u.prompt_tokens);
}
