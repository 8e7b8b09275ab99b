//! Protocol profiles: which operations an OpenAI-compatible adapter instance's upstream serves,
//! at which paths, and how it is authenticated. The Edge resolves a profile from its
//! configuration and pushes it to the Node inside the adapter's config (seed 000:
//! `OpenAICompatAdapterConfig.protocol_profile`); the HTTP surface then knows, per provider,
//! whether to pass a route through or translate it (see [`crate::http`]).
//!
//! | preset | operations (path relative to `base_url`) | auth header | fixed headers | for |
//! |---|---|---|---|---|
//! | `chat_only` | models `/models`, chat_completions `/chat/completions` | `Authorization: Bearer` | — | vLLM, llama.cpp, TGI, Ollama's `/v1`, Together, Groq, most OpenAI-compatible servers |
//! | `openai` | `chat_only` + responses `/responses` | `Authorization: Bearer` | — | OpenAI (`https://api.openai.com/v1`) |
//! | `anthropic` | messages `/messages`, count_tokens `/messages/count_tokens`, models `/models` | `x-api-key` | `anthropic-version: 2023-06-01` | Anthropic (`https://api.anthropic.com/v1`) |
//!
//! The auth header is where a key the Node holds itself is written (legacy mode; see
//! `iop_node::config`); managed leases declare their own header. An explicit profile lists
//! operations and paths by name instead (see [`Profile::custom`]).

use std::collections::BTreeMap;

use bytes::Bytes;
use iop_wire::runtime::{ConcreteProtocolProfile, Header, Operation};

/// The preset names.
pub const PRESETS: [&str; 3] = ["chat_only", "openai", "anthropic"];

/// The preset chosen when an adapter names none.
pub const DEFAULT_PRESET: &str = "chat_only";

/// The Anthropic API version the `anthropic` preset sends.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// Why a profile was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProfileError {
    /// No preset has this name.
    #[error("unknown profile preset `{0}` (presets: chat_only, openai, anthropic)")]
    UnknownPreset(String),
    /// An operation name is not one of the five.
    #[error(
        "unknown operation `{0}` (operations: models, chat_completions, responses, messages, count_tokens)"
    )]
    UnknownOperation(String),
    /// A path does not start with `/`.
    #[error("the path of `{0}` must start with `/`")]
    Path(String),
    /// No operation a route can use.
    #[error("a profile needs chat_completions, responses or messages")]
    Useless,
}

/// Profile constructors.
#[derive(Debug)]
pub struct Profile;

impl Profile {
    /// A preset by name (see the module table).
    pub fn preset(name: &str) -> Result<ConcreteProtocolProfile, ProfileError> {
        let ops: &[(Operation, &str)] = match name {
            "chat_only" => &[
                (Operation::Models, "/models"),
                (Operation::ChatCompletions, "/chat/completions"),
            ],
            "openai" => &[
                (Operation::Models, "/models"),
                (Operation::ChatCompletions, "/chat/completions"),
                (Operation::Responses, "/responses"),
            ],
            "anthropic" => &[
                (Operation::Models, "/models"),
                (Operation::Messages, "/messages"),
                (Operation::CountTokens, "/messages/count_tokens"),
            ],
            other => return Err(ProfileError::UnknownPreset(other.to_owned())),
        };
        let mut p = ConcreteProtocolProfile {
            name: name.to_owned(),
            operation_paths: ops.iter().map(|(o, p)| (*o, (*p).to_owned())).collect(),
            ..ConcreteProtocolProfile::default()
        };
        if name == "anthropic" {
            "x-api-key".clone_into(&mut p.auth_header);
            p.headers.push(Header {
                name: "anthropic-version".into(),
                value: Bytes::from_static(ANTHROPIC_VERSION.as_bytes()),
            });
        }
        Ok(p)
    }

    /// A profile named `name` with explicit `operation → path` entries, starting from the
    /// preset `base`'s auth header and fixed headers (e.g. an Anthropic-compatible server that
    /// lacks `count_tokens`).
    pub fn custom(
        name: &str,
        base: &str,
        operations: &BTreeMap<String, String>,
    ) -> Result<ConcreteProtocolProfile, ProfileError> {
        let mut p = Self::preset(base)?;
        name.clone_into(&mut p.name);
        p.operation_paths.clear();
        for (op, path) in operations {
            let parsed =
                Operation::parse(op).ok_or_else(|| ProfileError::UnknownOperation(op.clone()))?;
            if !path.starts_with('/') {
                return Err(ProfileError::Path(op.clone()));
            }
            p.operation_paths.insert(parsed, path.clone());
        }
        if ![
            Operation::ChatCompletions,
            Operation::Responses,
            Operation::Messages,
        ]
        .iter()
        .any(|o| p.serves(*o))
        {
            return Err(ProfileError::Useless);
        }
        Ok(p)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn presets_declare_what_their_upstreams_serve() {
        let a = Profile::preset("anthropic").unwrap();
        assert!(a.serves(Operation::Messages) && !a.serves(Operation::ChatCompletions));
        assert_eq!(a.credential_header(), ("x-api-key", ""));
        assert_eq!(a.headers[0].name, "anthropic-version");
        let o = Profile::preset("openai").unwrap();
        assert!(o.serves(Operation::Responses));
        assert_eq!(o.credential_header(), ("authorization", "Bearer "));
        let c = Profile::preset(DEFAULT_PRESET).unwrap();
        assert!(c.serves(Operation::ChatCompletions) && !c.serves(Operation::Responses));
        assert_eq!(
            Profile::preset("nope"),
            Err(ProfileError::UnknownPreset("nope".into()))
        );
        let ops: BTreeMap<String, String> =
            [("messages".to_owned(), "/v1/messages".to_owned())].into();
        let custom = Profile::custom("mine", "anthropic", &ops).unwrap();
        assert_eq!(custom.name, "mine");
        assert_eq!(custom.operation_paths.len(), 1);
        assert_eq!(custom.auth_header, "x-api-key");
        let bad: BTreeMap<String, String> = [("chat".to_owned(), "/x".to_owned())].into();
        assert!(matches!(
            Profile::custom("m", "openai", &bad),
            Err(ProfileError::UnknownOperation(_))
        ));
        let useless: BTreeMap<String, String> = [("models".to_owned(), "/m".to_owned())].into();
        assert_eq!(
            Profile::custom("m", "openai", &useless),
            Err(ProfileError::Useless)
        );
    }
}
