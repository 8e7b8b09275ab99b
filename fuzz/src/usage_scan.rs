//! Untrusted provider bytes through `iop_dialect::usage::UsageScanner` (the Node reading the
//! token usage out of a provider's response body, on the side of the bytes it tunnels to the
//! Edge untouched).
//!
//! Input: byte 0 is the size of the reads the body arrives in (1–255); byte 1's low bit says
//! whether the body is an SSE stream (1) or a JSON body (0), and its next bit whether the
//! scanner has small bounds (`SMALL_LINE`, `SMALL_BODY`: the smoke run's inputs are at most
//! 4 KiB, far under the real 256 KiB line and 1 MiB body, and the dropping of an overlong line
//! cut anywhere is the subtlest part to keep split-invariant); the rest is the body.
//!
//! Oracles: never panics; what is handed out does not depend on how the body is cut (whole, in
//! reads of the chosen size, one byte at a time for short bodies): the last figures `update`
//! handed out after a read (a stream's own end seen), and what `finish` adds at the body's end;
//! two hand-outs in a row never repeat the same figures;
//! every figure is consistent (total = input + output, cached at most the input); the scanner
//! never holds more than twice its documented bound.

use iop_dialect::usage::{MAX_BODY_SCAN, MAX_SSE_LINE, TokenUsage, UsageScanner};

/// The small bounds: the longest SSE line and the largest JSON body read.
const SMALL_LINE: usize = 64;
const SMALL_BODY: usize = 256;

/// One input.
pub fn run(data: &[u8]) {
    let [read, mode, body @ ..] = data else {
        return;
    };
    let sse = mode & 1 == 1;
    let bounds = if mode & 2 == 2 {
        (SMALL_LINE, SMALL_BODY)
    } else {
        (MAX_SSE_LINE, MAX_BODY_SCAN)
    };
    let whole = scan(body, sse, bounds, body.len().max(1));
    let parts = scan(body, sse, bounds, usize::from(*read).max(1));
    assert_eq!(whole, parts, "the usage depends on the cut");
    if body.len() <= 512 {
        assert_eq!(
            whole,
            scan(body, sse, bounds, 1),
            "the usage depends on the cut"
        );
    }
}

/// For `body` fed in reads of `read` bytes: the last usage `update` handed out, and what
/// `finish` handed out.
fn scan(
    body: &[u8],
    sse: bool,
    (max_line, max_body): (usize, usize),
    read: usize,
) -> (Option<TokenUsage>, Option<TokenUsage>) {
    let bound = 2 * if sse { max_line } else { max_body };
    let mut scanner = UsageScanner::with_bounds(sse, max_line, max_body);
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
