//! The built-in `demo` adapter: needs no network and streams deterministic text, for the local
//! mesh and for tests.
//!
//! For an input — plain UTF-8 text, or the normalized `{"messages": [...]}` JSON, whose last
//! message's `content` is used — it streams `echo: <text>` word by word, `repeat` times, waiting
//! `delay_ms` before each word. Options (from `NativeAdapterConfig.options`): `delay_ms`
//! (default 0), `repeat` (default 1, at most 10000), `healthy` (`"false"` makes probes report
//! `unavailable`), `stall_on` (an input equal to it streams its first word and then goes
//! silent until the Node fences the attempt: a provider stall, for the watchdog's tests and
//! the mesh simulation).

use std::time::Duration;

use async_trait::async_trait;
use iop_wire::runtime::{AdapterConfig, AdapterSettings, ProviderStatus, RunRequest, Usage};

use crate::adapter::{Adapter, AdapterError, RunCompletion, RunEvents};
use crate::credential::UpstreamCredential;

/// The demo adapter.
#[derive(Clone, Debug)]
pub struct DemoAdapter {
    delay: Duration,
    repeat: u32,
    healthy: bool,
    stall_on: Option<String>,
    targets: Vec<String>,
}

impl DemoAdapter {
    /// Builds it from its instance configuration (unknown or malformed options fall back to
    /// their defaults).
    pub fn from_config(config: &AdapterConfig) -> Self {
        let opt = |k: &str| match &config.settings {
            AdapterSettings::Native(n) => n.options.get(k).cloned(),
            _ => None,
        };
        Self {
            delay: Duration::from_millis(opt("delay_ms").and_then(|v| v.parse().ok()).unwrap_or(0)),
            repeat: opt("repeat")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1)
                .clamp(1, 10_000),
            healthy: opt("healthy").as_deref() != Some("false"),
            stall_on: opt("stall_on").filter(|s| !s.is_empty()),
            targets: config.targets.clone(),
        }
    }

    /// The deterministic reply to `input`, as the deltas it streams.
    pub fn reply(input: &str, repeat: u32) -> Vec<String> {
        let text = format!("echo: {input}");
        let words: Vec<&str> = text.split_inclusive(' ').collect();
        (0..repeat)
            .flat_map(|_| words.iter().map(|w| (*w).to_owned()))
            .collect()
    }
}

#[async_trait]
impl Adapter for DemoAdapter {
    async fn run(
        &self,
        request: RunRequest,
        events: RunEvents,
    ) -> Result<RunCompletion, AdapterError> {
        if !self.targets.is_empty() && !self.targets.contains(&request.target) {
            return Err(AdapterError::UnknownTarget);
        }
        let input = &crate::adapter::last_message_text(&request.input)?;
        // One word at a time, made as it is sent: a long reply holds the input text only, not
        // a string per word.
        let text = format!("echo: {input}");
        let deltas = (0..self.repeat).flat_map(|_| text.split_inclusive(' '));
        let stalls = self.stall_on.as_deref() == Some(input);
        let mut completion_tokens = 0u64;
        for d in deltas {
            if stalls && completion_tokens == 1 {
                // Silence until the watchdog fences the attempt; then return at once (the
                // fence is confirmed).
                events.cancelled().await;
                return Err(AdapterError::Provider("fenced".into()));
            }
            if !self.delay.is_zero() {
                tokio::select! {
                    () = events.cancelled() => return Err(AdapterError::Provider("fenced".into())),
                    () = tokio::time::sleep(self.delay) => {}
                }
            }
            if !events.delta(d).await {
                break;
            }
            completion_tokens += 1;
        }
        let prompt_tokens = u64::try_from(input.split_whitespace().count()).unwrap_or(u64::MAX);
        Ok(RunCompletion {
            metadata: Default::default(),
            usage: Some(Usage {
                prompt_tokens,
                completion_tokens,
                total_tokens: prompt_tokens + completion_tokens,
                cached_prompt_tokens: 0,
            }),
        })
    }

    async fn probe(
        &self,
        target: &str,
        _credential: Option<&UpstreamCredential>,
    ) -> ProviderStatus {
        if !self.healthy || (!self.targets.is_empty() && !self.targets.iter().any(|t| t == target))
        {
            ProviderStatus::Unavailable
        } else {
            ProviderStatus::Available
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_is_deterministic() {
        assert_eq!(
            DemoAdapter::reply("hi there", 2),
            ["echo: ", "hi ", "there", "echo: ", "hi ", "there"]
        );
    }
}
