//! The lease service against a real store: a granted lease opens at the selected Node with
//! exactly the slot's credential; every stale, disabled, mismatched or cross-principal binding
//! is refused with its own reason and without decrypting anything.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::Arc;
use std::time::Duration;

use iop_cp::admin::Admin;
use iop_cp::lease::{LeaseRefusal, LeaseService};
use iop_cp::seal::MasterKey;
use iop_cp::store::{Mutation, SqliteStore, Store};
use iop_lease::{
    IssuerSigningKey, MemoryReplayGuard, OpenPolicy, Recipient, RecipientSecretKey, TrustedIssuers,
};
use iop_wire::control::AcquireLeaseRequest;
use iop_wire::runtime::{CredentialLeaseBinding, ManagedCredential};

struct World {
    admin: Admin,
    leases: LeaseService,
    node: Recipient,
}

async fn world() -> World {
    let store: Arc<dyn Store> = Arc::new(SqliteStore::in_memory().unwrap());
    let admin = Admin::new(store.clone(), Arc::new(MasterKey::generate().unwrap().0), 1);
    let issuer = admin
        .ensure_issuer_key(|| Ok(IssuerSigningKey::generate_derived().unwrap()))
        .await
        .unwrap();
    let trusted: TrustedIssuers = [issuer.public_key()].into_iter().collect();
    let node = Recipient::new(
        RecipientSecretKey::generate("node-1-key").unwrap(),
        trusted,
        OpenPolicy::default(),
    );
    let leases = LeaseService::new(store, admin.master_key().clone(), Duration::from_secs(30));
    admin.create_principal("team-a", "A").await.unwrap();
    admin.create_principal("team-b", "B").await.unwrap();
    admin
        .put_slot("slot-1", "openai", "authorization", "Bearer ", b"sk-one")
        .await
        .unwrap();
    admin
        .put_slot("slot-2", "openai", "x-api-key", "", b"sk-two")
        .await
        .unwrap();
    admin
        .put_route("r1", "team-a", "gpt", "slot-1", "gpt-4o", "")
        .await
        .unwrap();
    admin
        .put_route("r2", "team-b", "gpt", "slot-2", "gpt-4o", "")
        .await
        .unwrap();
    World {
        admin,
        leases,
        node,
    }
}

async fn binding(w: &World) -> CredentialLeaseBinding {
    CredentialLeaseBinding {
        principal_id: "team-a".into(),
        slot_id: "slot-1".into(),
        route_id: "r1".into(),
        profile: "openai".into(),
        upstream_target: "gpt-4o".into(),
        node_id: "node-1".into(),
        recipient_key_id: "node-1-key".into(),
        credential_revision: 1,
        route_revision: 1,
        projection_generation: w.admin.store().generation().await.unwrap(),
    }
}

fn request(w: &World, binding: CredentialLeaseBinding) -> AcquireLeaseRequest {
    AcquireLeaseRequest {
        binding,
        recipient_public_key: *w.node.public_key().as_bytes(),
        trace: None,
    }
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[tokio::test]
async fn granted_lease_opens_with_exactly_the_slot_credential() {
    let w = world().await;
    let b = binding(&w).await;
    let lease = w
        .leases
        .acquire(&request(&w, b.clone()), now())
        .await
        .unwrap();
    let envelope = ManagedCredential {
        lease,
        binding: b.clone(),
    };
    let opened = w
        .node
        .open(&envelope, &b, now(), &mut MemoryReplayGuard::default())
        .unwrap();
    let mut headers = http::HeaderMap::new();
    opened.inject(&mut headers);
    assert_eq!(headers["authorization"], "Bearer sk-one");
    assert_eq!(headers.len(), 1);
}

#[tokio::test]
async fn every_mismatch_is_refused_with_its_reason() {
    let w = world().await;
    let b = binding(&w).await;
    type Mutate = Box<dyn Fn(&mut CredentialLeaseBinding)>;
    let cases: Vec<(Mutate, LeaseRefusal)> = vec![
        (
            Box::new(|b| b.projection_generation -= 1),
            LeaseRefusal::StaleGeneration,
        ),
        (
            Box::new(|b| b.projection_generation += 1),
            LeaseRefusal::StaleGeneration,
        ),
        (
            Box::new(|b| b.route_id = "nope".into()),
            LeaseRefusal::RouteUnavailable,
        ),
        // Cross-principal: team-a's route named with team-b as the principal.
        (
            Box::new(|b| b.principal_id = "team-b".into()),
            LeaseRefusal::PrincipalMismatch,
        ),
        // team-a's route with team-b's slot.
        (
            Box::new(|b| b.slot_id = "slot-2".into()),
            LeaseRefusal::SlotUnavailable,
        ),
        (
            Box::new(|b| b.profile = "anthropic".into()),
            LeaseRefusal::ScopeMismatch,
        ),
        (
            Box::new(|b| b.upstream_target = "gpt-5".into()),
            LeaseRefusal::ScopeMismatch,
        ),
        (
            Box::new(|b| b.route_revision = 2),
            LeaseRefusal::StaleRevision,
        ),
        (
            Box::new(|b| b.credential_revision = 2),
            LeaseRefusal::StaleRevision,
        ),
    ];
    for (mutate, want) in cases {
        let mut m = b.clone();
        mutate(&mut m);
        assert_eq!(
            w.leases
                .acquire(&request(&w, m.clone()), now())
                .await
                .unwrap_err(),
            want,
            "{m:?}"
        );
    }
    // A recipient key that is not a valid X25519 point for the binding's key id.
    let mut req = request(&w, b.clone());
    req.recipient_public_key = [0; 32];
    assert_eq!(
        w.leases.acquire(&req, now()).await.unwrap_err(),
        LeaseRefusal::RecipientMismatch
    );
}

#[tokio::test]
async fn state_changes_after_the_projection_fail_closed() {
    // Each mutation bumps the generation, so a binding made before it is stale; a binding made
    // after it (current generation) still fails on the state itself.
    type Case = (Mutation, LeaseRefusal);
    let cases: Vec<Case> = vec![
        (
            Mutation::SetRouteEnabled {
                id: "r1".into(),
                enabled: false,
            },
            LeaseRefusal::RouteUnavailable,
        ),
        (
            Mutation::SetSlotEnabled {
                id: "slot-1".into(),
                enabled: false,
            },
            LeaseRefusal::SlotUnavailable,
        ),
        (
            Mutation::SetPrincipalEnabled {
                id: "team-a".into(),
                enabled: false,
            },
            LeaseRefusal::PrincipalMismatch,
        ),
    ];
    for (mutation, after) in cases {
        let w = world().await;
        let before = binding(&w).await;
        w.admin.apply(mutation.clone()).await.unwrap();
        assert_eq!(
            w.leases
                .acquire(&request(&w, before), now())
                .await
                .unwrap_err(),
            LeaseRefusal::StaleGeneration,
            "{mutation:?}"
        );
        let current = binding(&w).await;
        assert_eq!(
            w.leases
                .acquire(&request(&w, current), now())
                .await
                .unwrap_err(),
            after,
            "{mutation:?}"
        );
    }
    // Rotation: the old revision is refused even at the current generation; the new one gets
    // the new credential.
    let w = world().await;
    w.admin
        .put_slot(
            "slot-1",
            "openai",
            "authorization",
            "Bearer ",
            b"sk-rotated",
        )
        .await
        .unwrap();
    let mut b = binding(&w).await;
    assert_eq!(
        w.leases
            .acquire(&request(&w, b.clone()), now())
            .await
            .unwrap_err(),
        LeaseRefusal::StaleRevision
    );
    b.credential_revision = 2;
    let lease = w
        .leases
        .acquire(&request(&w, b.clone()), now())
        .await
        .unwrap();
    let opened = w
        .node
        .open(
            &ManagedCredential {
                lease,
                binding: b.clone(),
            },
            &b,
            now(),
            &mut MemoryReplayGuard::default(),
        )
        .unwrap();
    let mut headers = http::HeaderMap::new();
    opened.inject(&mut headers);
    assert_eq!(headers["authorization"], "Bearer sk-rotated");
}
