//! Desired-state version rules (seed `003`, "Desired State Pull" and "Apply Result"), as pure
//! functions over the control plane's records.
//!
//! - A runtime's `current_version` advances to `v` only when **every** RuntimeConfiguration of
//!   `v` was reported `applied` (the apply results are the record; nothing advances on a pull).
//! - The desired state returned is the **latest** published version while it is above the
//!   runtime's current applied version — also when that version went `failed` or `rolled_back`,
//!   so that a fix (a newer version) or a runtime upgrade retries it and converges.
//! - `304` only when the runtime's applied version (per the apply results) is the latest and
//!   its `X-OrbitMesh-Current-Version` says the same; the header never hides a version the
//!   record does not show applied.

use std::collections::BTreeMap;

/// An apply result status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ApplyStatus {
    /// Applied successfully.
    Applied,
    /// Failed to apply.
    Failed,
    /// Applied, then rolled back.
    RolledBack,
}

impl ApplyStatus {
    /// The wire value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Failed => "failed",
            Self::RolledBack => "rolled_back",
        }
    }

    /// Parses the wire value.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "applied" => Some(Self::Applied),
            "failed" => Some(Self::Failed),
            "rolled_back" => Some(Self::RolledBack),
            _ => None,
        }
    }
}

/// What `GET desired-state` answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DesiredAnswer {
    /// `304 Not Modified`.
    NotModified,
    /// `200` with this version's RuntimeConfigurations.
    Version(u64),
}

/// The version to hand out: the latest published one while it is above `current_applied`;
/// otherwise the runtime's own current version (nothing to do).
pub fn target_version(latest_published: Option<u64>, current_applied: u64) -> u64 {
    match latest_published {
        Some(latest) if latest > current_applied => latest,
        _ => current_applied,
    }
}

/// The answer to a pull carrying `X-OrbitMesh-Current-Version: header_current` (if sent).
///
/// The control plane's record of apply results wins over the header: while the version to
/// hand out is above the runtime's *successfully applied* version (it is new, or it went
/// `failed` / `rolled_back`, or its results were not reported yet), it is returned (`200`)
/// whatever the header says — a runtime that failed version 3 and now sends
/// `X-OrbitMesh-Current-Version: 3` gets version 3 again, so it retries and converges. `304`
/// only when the runtime's applied version is the latest and the header agrees with it.
pub fn desired_answer(
    latest_published: Option<u64>,
    current_applied: u64,
    header_current: Option<u64>,
) -> DesiredAnswer {
    if latest_published.is_none() {
        return DesiredAnswer::NotModified;
    }
    let target = target_version(latest_published, current_applied);
    if target == current_applied && header_current == Some(current_applied) {
        DesiredAnswer::NotModified
    } else {
        DesiredAnswer::Version(target)
    }
}

/// The runtime's current applied version after recording results for `version`:
/// `results` maps each RuntimeConfiguration id of `version` that has a reported result to that
/// result; `configurations` lists every configuration id of `version`. Advances to `version`
/// only if it is newer and every configuration is `applied`; never moves back.
pub fn advance(
    current_applied: u64,
    version: u64,
    configurations: &[String],
    results: &BTreeMap<String, ApplyStatus>,
) -> u64 {
    let all_applied = configurations
        .iter()
        .all(|c| results.get(c) == Some(&ApplyStatus::Applied));
    if version > current_applied && all_applied {
        version
    } else {
        current_applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn results(pairs: &[(&str, ApplyStatus)]) -> BTreeMap<String, ApplyStatus> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }

    #[test]
    fn pulls_304_and_retry_of_failed_versions() {
        // Nothing published yet.
        assert_eq!(desired_answer(None, 0, None), DesiredAnswer::NotModified);
        assert_eq!(desired_answer(None, 0, Some(0)), DesiredAnswer::NotModified);
        // Version 3 published, runtime at 0.
        assert_eq!(
            desired_answer(Some(3), 0, Some(0)),
            DesiredAnswer::Version(3)
        );
        assert_eq!(desired_answer(Some(3), 0, None), DesiredAnswer::Version(3));
        // The runtime says 3, but no apply result reported 3 applied: the record wins, 3 again
        // (a runtime whose version 3 failed keeps getting it).
        assert_eq!(
            desired_answer(Some(3), 0, Some(3)),
            DesiredAnswer::Version(3)
        );
        assert_eq!(
            desired_answer(Some(3), 2, Some(3)),
            DesiredAnswer::Version(3)
        );
        // The record says 3 applied but the runtime reports another version: it gets 3 back.
        assert_eq!(
            desired_answer(Some(3), 3, Some(2)),
            DesiredAnswer::Version(3)
        );
        assert_eq!(desired_answer(Some(3), 3, None), DesiredAnswer::Version(3));
        // 3 failed: the runtime stays at 2 and keeps getting 3.
        assert_eq!(
            desired_answer(Some(3), 2, Some(2)),
            DesiredAnswer::Version(3)
        );
        // Applied and reported: 304 at 3.
        assert_eq!(
            desired_answer(Some(3), 3, Some(3)),
            DesiredAnswer::NotModified
        );
    }

    #[test]
    fn advance_only_when_every_configuration_applied() {
        let configs = vec!["a".to_owned(), "b".to_owned()];
        assert_eq!(
            advance(2, 3, &configs, &results(&[("a", ApplyStatus::Applied)])),
            2
        );
        assert_eq!(
            advance(
                2,
                3,
                &configs,
                &results(&[("a", ApplyStatus::Applied), ("b", ApplyStatus::Failed)])
            ),
            2
        );
        assert_eq!(
            advance(
                2,
                3,
                &configs,
                &results(&[("a", ApplyStatus::Applied), ("b", ApplyStatus::RolledBack)])
            ),
            2
        );
        assert_eq!(
            advance(
                2,
                3,
                &configs,
                &results(&[("a", ApplyStatus::Applied), ("b", ApplyStatus::Applied)])
            ),
            3
        );
        // Never back.
        assert_eq!(
            advance(
                5,
                3,
                &configs,
                &results(&[("a", ApplyStatus::Applied), ("b", ApplyStatus::Applied)])
            ),
            5
        );
        // A version without configurations applies trivially once reported.
        assert_eq!(advance(0, 1, &[], &BTreeMap::new()), 1);
    }

    #[test]
    fn statuses_round_trip() {
        for s in [
            ApplyStatus::Applied,
            ApplyStatus::Failed,
            ApplyStatus::RolledBack,
        ] {
            assert_eq!(ApplyStatus::parse(s.as_str()), Some(s));
        }
        assert_eq!(ApplyStatus::parse("Applied"), None);
    }
}
