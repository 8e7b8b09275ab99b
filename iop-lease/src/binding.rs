//! The canonical byte encoding of a [`CredentialLeaseBinding`].
//!
//! ```text
//! "iop-lease/binding/v1" 0x00
//! u32be len || principal_id
//! u32be len || slot_id
//! u32be len || route_id
//! u32be len || profile
//! u32be len || upstream_target
//! u32be len || node_id
//! u32be len || recipient_key_id
//! u64be credential_revision
//! u64be route_revision
//! u64be projection_generation
//! ```
//!
//! Fields are in a fixed order and every variable-length field is length-prefixed, so the
//! encoding is injective: [`decode`] recovers the binding from it, hence two different bindings
//! never encode the same. The signature, the HPKE `info` and the lease's scope all use it.

use iop_wire::runtime::CredentialLeaseBinding;

const TAG: &[u8] = b"iop-lease/binding/v1\0";

fn put(out: &mut Vec<u8>, field: &str) {
    // Field lengths are bounded by iop-wire's validation (<= 256 bytes); a u32 cannot overflow.
    out.extend_from_slice(&u32::try_from(field.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(field.as_bytes());
}

/// The canonical encoding.
pub fn encode(b: &CredentialLeaseBinding) -> Vec<u8> {
    let mut out = Vec::with_capacity(TAG.len() + 7 * 4 + 24 + 256);
    out.extend_from_slice(TAG);
    for field in [
        &b.principal_id,
        &b.slot_id,
        &b.route_id,
        &b.profile,
        &b.upstream_target,
        &b.node_id,
        &b.recipient_key_id,
    ] {
        put(&mut out, field);
    }
    for n in [
        b.credential_revision,
        b.route_revision,
        b.projection_generation,
    ] {
        out.extend_from_slice(&n.to_be_bytes());
    }
    out
}

/// Parses a canonical encoding (the inverse of [`encode`]); `None` if it is not one.
pub fn decode(mut bytes: &[u8]) -> Option<CredentialLeaseBinding> {
    bytes = bytes.strip_prefix(TAG)?;
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, rest) = bytes.split_at_checked(n)?;
        bytes = rest;
        Some(head)
    };
    let mut strings = Vec::with_capacity(7);
    for _ in 0..7 {
        let len = u32::from_be_bytes(take(4)?.try_into().ok()?);
        let s = std::str::from_utf8(take(usize::try_from(len).ok()?)?).ok()?;
        strings.push(s.to_owned());
    }
    let mut nums = [0u64; 3];
    for n in &mut nums {
        *n = u64::from_be_bytes(take(8)?.try_into().ok()?);
    }
    if !bytes.is_empty() {
        return None; // trailing bytes
    }
    let mut s = strings.into_iter();
    Some(CredentialLeaseBinding {
        principal_id: s.next()?,
        slot_id: s.next()?,
        route_id: s.next()?,
        profile: s.next()?,
        upstream_target: s.next()?,
        node_id: s.next()?,
        recipient_key_id: s.next()?,
        credential_revision: nums[0],
        route_revision: nums[1],
        projection_generation: nums[2],
    })
}

/// The first field where `a` and `b` differ, by name.
pub(crate) fn first_difference(
    a: &CredentialLeaseBinding,
    b: &CredentialLeaseBinding,
) -> Option<&'static str> {
    let strings = [
        ("principal_id", &a.principal_id, &b.principal_id),
        ("slot_id", &a.slot_id, &b.slot_id),
        ("route_id", &a.route_id, &b.route_id),
        ("profile", &a.profile, &b.profile),
        ("upstream_target", &a.upstream_target, &b.upstream_target),
        ("node_id", &a.node_id, &b.node_id),
        ("recipient_key_id", &a.recipient_key_id, &b.recipient_key_id),
    ];
    let nums = [
        (
            "credential_revision",
            a.credential_revision,
            b.credential_revision,
        ),
        ("route_revision", a.route_revision, b.route_revision),
        (
            "projection_generation",
            a.projection_generation,
            b.projection_generation,
        ),
    ];
    strings
        .into_iter()
        .find(|(_, x, y)| x != y)
        .map(|(name, _, _)| name)
        .or_else(|| {
            nums.into_iter()
                .find(|(_, x, y)| x != y)
                .map(|(name, _, _)| name)
        })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn arb_binding() -> impl Strategy<Value = CredentialLeaseBinding> {
        // Short strings over a tiny alphabet make collisions between fields likely, which is
        // exactly where a non-injective encoding would show.
        let s = || "[ab]{0,3}";
        (
            (s(), s(), s(), s(), s(), s(), s()),
            (0u64..3, 0u64..3, 0u64..3),
        )
            .prop_map(
                |((p, sl, r, pr, t, n, k), (c, rr, g))| CredentialLeaseBinding {
                    principal_id: p,
                    slot_id: sl,
                    route_id: r,
                    profile: pr,
                    upstream_target: t,
                    node_id: n,
                    recipient_key_id: k,
                    credential_revision: c,
                    route_revision: rr,
                    projection_generation: g,
                },
            )
    }

    proptest! {
        #[test]
        fn decode_inverts_encode(b in arb_binding()) {
            prop_assert_eq!(decode(&encode(&b)), Some(b));
        }

        /// `b` is `a` with one field replaced by a value from the same tiny alphabet, so about
        /// a third of the cases are equal bindings and the rest differ in exactly that field:
        /// both sides of the equivalence are exercised, not only "two random bindings differ".
        #[test]
        fn different_bindings_never_encode_the_same(
            a in arb_binding(),
            field in 0usize..10,
            text in "[ab]{0,2}",
            num in 0u64..2,
        ) {
            let mut b = a.clone();
            let names = [
                "principal_id", "slot_id", "route_id", "profile", "upstream_target", "node_id",
                "recipient_key_id", "credential_revision", "route_revision", "projection_generation",
            ];
            match field {
                0 => b.principal_id.clone_from(&text),
                1 => b.slot_id.clone_from(&text),
                2 => b.route_id.clone_from(&text),
                3 => b.profile.clone_from(&text),
                4 => b.upstream_target.clone_from(&text),
                5 => b.node_id.clone_from(&text),
                6 => b.recipient_key_id.clone_from(&text),
                7 => b.credential_revision = num,
                8 => b.route_revision = num,
                _ => b.projection_generation = num,
            }
            prop_assert_eq!(a == b, encode(&a) == encode(&b));
            prop_assert_eq!(first_difference(&a, &b), (a != b).then_some(names[field]));
        }

        /// Arbitrary bytes never panic the parser, and what it accepts is canonical: the
        /// binding it returns encodes back to exactly those bytes (no second encoding of one
        /// binding exists, trailing bytes included).
        #[test]
        fn decode_accepts_only_canonical_encodings(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Some(b) = decode(&bytes) {
                prop_assert_eq!(encode(&b), bytes);
            }
        }

        /// Mutating one byte of a real encoding yields either a parse failure or a different
        /// binding whose encoding is the mutated bytes.
        #[test]
        fn a_changed_byte_is_refused_or_is_another_binding(
            a in arb_binding(),
            at in any::<proptest::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let mut bytes = encode(&a);
            let i = at.index(bytes.len());
            bytes[i] ^= flip;
            match decode(&bytes) {
                None => {}
                Some(b) => {
                    prop_assert_ne!(&b, &a);
                    prop_assert_eq!(encode(&b), bytes);
                }
            }
        }
    }

    #[test]
    fn field_boundaries_matter() {
        // "ab" + "" vs "a" + "b": a naive concatenation would collide.
        let x = CredentialLeaseBinding {
            principal_id: "ab".into(),
            ..Default::default()
        };
        let y = CredentialLeaseBinding {
            principal_id: "a".into(),
            slot_id: "b".into(),
            ..Default::default()
        };
        assert_ne!(encode(&x), encode(&y));
        assert_eq!(first_difference(&x, &y), Some("principal_id"));
    }
}
