//! One contract suite, run unchanged against both store backends: SQLite (a temporary file)
//! and PostgreSQL (the database named by `IOP_TEST_PG_URL`, which `scripts/test-all.sh`
//! creates on a local server for each run and drops afterwards; each test uses its own schema).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use iop_cp::store::{
    DailyUsage, ModelLimits, Mutation, PgStore, PrincipalLimits, SqliteStore, Store, StoreError,
    UsageRecord, UsageStored,
};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Opens two handles on one fresh store: as two replicas (PostgreSQL) or two connections to
/// one file (SQLite).
trait Backend {
    async fn pair() -> (Arc<dyn Store>, Arc<dyn Store>);
}

struct Sqlite;
impl Backend for Sqlite {
    async fn pair() -> (Arc<dyn Store>, Arc<dyn Store>) {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("iop-cp-contract-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("store.sqlite3");
        (
            Arc::new(SqliteStore::open(&path).unwrap()),
            Arc::new(SqliteStore::open(&path).unwrap()),
        )
    }
}

struct Postgres;
impl Backend for Postgres {
    async fn pair() -> (Arc<dyn Store>, Arc<dyn Store>) {
        let url = std::env::var("IOP_TEST_PG_URL").expect(
            "IOP_TEST_PG_URL is not set: run scripts/test-all.sh (it creates a PostgreSQL \
             database for the run), or set it to postgres://USER@127.0.0.1:5432/DB",
        );
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let schema = format!("contract_{}_{n}", std::process::id());
        (
            Arc::new(PgStore::connect_with_schema(&url, &schema).await.unwrap()),
            Arc::new(PgStore::connect_with_schema(&url, &schema).await.unwrap()),
        )
    }
}

fn principal(id: &str) -> Mutation {
    Mutation::CreatePrincipal {
        id: id.into(),
        display_name: format!("{id} team"),
    }
}

fn slot(id: &str, profile: &str, sealed: &[u8]) -> Mutation {
    Mutation::PutSlot {
        id: id.into(),
        profile: profile.into(),
        header_name: "authorization".into(),
        header_prefix: "Bearer ".into(),
        sealed: sealed.to_vec(),
    }
}

fn route(id: &str, principal: &str, model: &str, slot: &str) -> Mutation {
    Mutation::PutRoute {
        id: id.into(),
        principal_id: principal.into(),
        model: model.into(),
        slot_id: slot.into(),
        upstream_target: "gpt-4o-mini".into(),
        selector: String::new(),
    }
}

async fn generations_are_strict_and_logged<B: Backend>() {
    let (s, _) = B::pair().await;
    // A new store is generation 1 (projection generations start at 1 on the wire).
    assert_eq!(s.generation().await.unwrap(), 1);
    assert_eq!(s.snapshot().await.unwrap().generation, 1);
    let steps = [
        principal("team-a"),
        Mutation::CreateToken {
            id: "tok-1".into(),
            principal_id: "team-a".into(),
            digest: [7; 32],
        },
        slot("slot-1", "openai", b"sealed-1"),
        route("route-1", "team-a", "gpt", "slot-1"),
        Mutation::RevokeToken { id: "tok-1".into() },
    ];
    for (i, m) in steps.into_iter().enumerate() {
        assert_eq!(s.apply(m).await.unwrap(), i as u64 + 2);
    }
    assert_eq!(s.generation().await.unwrap(), 6);
    let log = s.revisions(0, 100).await.unwrap();
    let kinds: Vec<_> = log
        .iter()
        .map(|r| (r.generation, r.kind.as_str(), r.object_id.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [
            (2, "create_principal", "team-a"),
            (3, "create_token", "tok-1"),
            (4, "put_slot", "slot-1"),
            (5, "put_route", "route-1"),
            (6, "revoke_token", "tok-1"),
        ]
    );
    assert_eq!(s.revisions(4, 1).await.unwrap()[0].generation, 5);
}

async fn refused_mutations_change_nothing<B: Backend>() {
    let (s, _) = B::pair().await;
    s.apply(principal("team-a")).await.unwrap();
    let before = s.snapshot().await.unwrap();
    let refusals = [
        (principal("team-a"), StoreError::Conflict("principal")),
        (
            Mutation::CreateToken {
                id: "t".into(),
                principal_id: "nobody".into(),
                digest: [1; 32],
            },
            StoreError::NotFound("principal"),
        ),
        (
            Mutation::RevokeToken { id: "nope".into() },
            StoreError::NotFound("token"),
        ),
        (
            route("r", "team-a", "gpt", "no-slot"),
            StoreError::NotFound("slot"),
        ),
        (
            Mutation::SetSlotEnabled {
                id: "x".into(),
                enabled: false,
            },
            StoreError::NotFound("slot"),
        ),
        (
            Mutation::SetRouteEnabled {
                id: "x".into(),
                enabled: false,
            },
            StoreError::NotFound("route"),
        ),
        (
            Mutation::SetPrincipalEnabled {
                id: "x".into(),
                enabled: false,
            },
            StoreError::NotFound("principal"),
        ),
        (principal(""), StoreError::Invalid("principal id")),
        (principal("has space"), StoreError::Invalid("principal id")),
        (
            slot("s", "openai", b""),
            StoreError::Invalid("sealed credential"),
        ),
        (
            Mutation::PutSlot {
                id: "s".into(),
                profile: "openai".into(),
                header_name: "Bad Header".into(),
                header_prefix: String::new(),
                sealed: vec![1],
            },
            StoreError::Invalid("header name"),
        ),
        (
            Mutation::PutRoute {
                id: "r".into(),
                principal_id: "team-a".into(),
                model: "has space".into(),
                slot_id: "s".into(),
                upstream_target: "t".into(),
                selector: String::new(),
            },
            StoreError::Invalid("model"),
        ),
    ];
    for (m, want) in refusals {
        assert_eq!(s.apply(m.clone()).await.unwrap_err(), want, "{m:?}");
    }
    assert_eq!(s.snapshot().await.unwrap(), before);
    assert_eq!(s.generation().await.unwrap(), 2);
}

async fn tokens_slots_routes_and_revisions<B: Backend>() {
    let (s, _) = B::pair().await;
    s.apply(principal("team-a")).await.unwrap();
    s.apply(principal("team-b")).await.unwrap();
    s.apply(Mutation::CreateToken {
        id: "t1".into(),
        principal_id: "team-a".into(),
        digest: [9; 32],
    })
    .await
    .unwrap();
    // A digest is unique across all tokens.
    assert_eq!(
        s.apply(Mutation::CreateToken {
            id: "t2".into(),
            principal_id: "team-b".into(),
            digest: [9; 32]
        })
        .await
        .unwrap_err(),
        StoreError::Conflict("token")
    );
    s.apply(slot("slot-1", "openai", b"sealed-v1"))
        .await
        .unwrap();
    s.apply(route("r1", "team-a", "gpt", "slot-1"))
        .await
        .unwrap();
    // One route per principal and model.
    assert_eq!(
        s.apply(route("r2", "team-a", "gpt", "slot-1"))
            .await
            .unwrap_err(),
        StoreError::Conflict("route for this principal and model")
    );
    // Rotation and update bump their own revisions.
    s.apply(slot("slot-1", "openai", b"sealed-v2"))
        .await
        .unwrap();
    s.apply(route("r1", "team-a", "gpt", "slot-1"))
        .await
        .unwrap();
    s.apply(route("r1", "team-a", "gpt", "slot-1"))
        .await
        .unwrap();
    // A slot used by routes keeps its profile.
    assert_eq!(
        s.apply(slot("slot-1", "anthropic", b"x"))
            .await
            .unwrap_err(),
        StoreError::ProfileMismatch
    );
    // The latest revision of each object of a kind, with its time.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let puts = s.last_revisions("put_slot", 10).await.unwrap();
    assert_eq!(puts.len(), 1, "{puts:?}");
    assert_eq!(puts[0].object_id, "slot-1");
    let all = s.revisions(0, 1000).await.unwrap();
    let last_put = all.iter().rfind(|r| r.kind == "put_slot").unwrap();
    assert_eq!(&puts[0], last_put, "the second put, not the first");
    assert!(
        (now - 60_000..=now + 1000).contains(&puts[0].at_unix_ms),
        "{puts:?}"
    );
    let routes = s.last_revisions("put_route", 10).await.unwrap();
    assert_eq!(
        routes
            .iter()
            .map(|r| r.object_id.as_str())
            .collect::<Vec<_>>(),
        ["r1"]
    );
    assert_eq!(
        routes[0].generation,
        all.iter()
            .rfind(|r| r.kind == "put_route")
            .unwrap()
            .generation
    );
    assert_eq!(s.last_revisions("create_token", 10).await.unwrap().len(), 1);
    assert!(
        s.last_revisions("no_such_kind", 10)
            .await
            .unwrap()
            .is_empty()
    );
    let snap = s.snapshot().await.unwrap();
    assert_eq!(snap.slots.len(), 1);
    assert_eq!(snap.slots[0].revision, 2);
    assert!(
        snap.slots[0].sealed.is_empty(),
        "snapshots carry no sealed bytes"
    );
    assert_eq!(snap.routes[0].revision, 3);
    assert_eq!(snap.routes[0].profile, "openai");
    assert_eq!(snap.tokens.len(), 1);
    assert_eq!(snap.tokens[0].digest, [9; 32]);
    let view = s.lease_view("r1", "slot-1").await.unwrap();
    assert_eq!(view.generation, snap.generation);
    assert_eq!(view.slot.unwrap().sealed, b"sealed-v2");
    assert_eq!(view.route.unwrap().principal_id, "team-a");
    assert_eq!(view.principal.unwrap().id, "team-a");
    let none = s.lease_view("missing", "missing").await.unwrap();
    assert!(none.route.is_none() && none.slot.is_none() && none.principal.is_none());
    // Flags.
    s.apply(Mutation::SetSlotEnabled {
        id: "slot-1".into(),
        enabled: false,
    })
    .await
    .unwrap();
    s.apply(Mutation::SetRouteEnabled {
        id: "r1".into(),
        enabled: false,
    })
    .await
    .unwrap();
    s.apply(Mutation::SetPrincipalEnabled {
        id: "team-b".into(),
        enabled: false,
    })
    .await
    .unwrap();
    s.apply(Mutation::RevokeToken { id: "t1".into() })
        .await
        .unwrap();
    let snap = s.snapshot().await.unwrap();
    assert!(!snap.slots[0].enabled && !snap.routes[0].enabled && snap.tokens[0].revoked);
    assert!(
        !snap
            .principals
            .iter()
            .find(|p| p.id == "team-b")
            .unwrap()
            .enabled
    );
}

async fn concurrent_writers_get_distinct_generations<B: Backend>() {
    let (a, b) = B::pair().await;
    let mut tasks = Vec::new();
    for i in 0..24 {
        let s = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            s.apply(principal(&format!("p{i}"))).await.unwrap()
        }));
    }
    let mut gens = Vec::new();
    for t in tasks {
        gens.push(t.await.unwrap());
    }
    gens.sort_unstable();
    assert_eq!(gens, (2..=25).collect::<Vec<u64>>());
    assert_eq!(a.generation().await.unwrap(), 25);
    assert_eq!(b.snapshot().await.unwrap().principals.len(), 24);
    assert_eq!(a.revisions(0, 1000).await.unwrap().len(), 24);
}

/// A mutation through one handle (the CLI, another replica) ends the other's `wait_change`
/// long before its limit, and that handle then reads the new generation. The default
/// implementation (sleep the whole limit) fails this.
async fn a_change_elsewhere_ends_the_wait<B: Backend>() {
    let (a, b) = B::pair().await;
    b.wait_change(std::time::Duration::ZERO).await;
    let waiter = tokio::spawn(async move {
        // A spurious wake-up (e.g. the PostgreSQL listener's after it connected) only loops.
        for _ in 0..100 {
            b.wait_change(std::time::Duration::from_secs(3600)).await;
            let g = b.generation().await.unwrap();
            if g > 1 {
                return g;
            }
        }
        panic!("woken 100 times without a change");
    });
    let g = a.apply(principal("elsewhere")).await.unwrap();
    let seen = tokio::time::timeout(std::time::Duration::from_secs(30), waiter)
        .await
        .expect("the change ended the wait")
        .unwrap();
    assert_eq!(seen, g);
}

/// Issuer keys: the first install is active; a second install (another replica racing) is
/// refused and changes nothing; a staged key needs an active one and is alone; activation
/// swaps them in one generation, deletes the old key, and only the first of two replicas'
/// activations succeeds. Snapshots never carry the sealed bytes; the lease view carries the
/// active key's.
async fn issuer_keys_install_stage_and_activate<B: Backend>() {
    let (a, b) = B::pair().await;
    let stage = |id: &str, at: i64| Mutation::StageIssuerKey {
        id: id.into(),
        sealed: format!("sealed-{id}").into_bytes(),
        activates_at_unix_ms: at,
    };
    let install = |id: &str| Mutation::InstallIssuerKey {
        id: id.into(),
        sealed: format!("sealed-{id}").into_bytes(),
    };
    assert_eq!(
        a.apply(stage("p256:aa", 5)).await,
        Err(StoreError::NotFound("active issuer key"))
    );
    let g1 = a.apply(install("p256:aa")).await.unwrap();
    assert_eq!(
        b.apply(install("p256:bb")).await,
        Err(StoreError::Conflict("active issuer key"))
    );
    assert_eq!(
        b.apply(install("p256:aa")).await,
        Err(StoreError::Conflict("issuer key"))
    );
    assert_eq!(b.generation().await.unwrap(), g1);
    assert_eq!(
        b.apply(stage("p256:aa", 5)).await,
        Err(StoreError::Conflict("issuer key")),
        "the active key's own id"
    );
    assert_eq!(
        b.apply(stage("p256:cc", 0)).await,
        Err(StoreError::Invalid("issuer key activation time"))
    );
    let g2 = b.apply(stage("p256:cc", 1_900_000_000_000)).await.unwrap();
    assert_eq!(g2, g1 + 1);
    assert_eq!(
        a.apply(stage("p256:dd", 7)).await,
        Err(StoreError::Conflict("staged issuer key"))
    );
    let snap = a.snapshot().await.unwrap();
    assert_eq!(snap.generation, g2);
    assert_eq!(snap.active_issuer().map(|k| k.id.as_str()), Some("p256:aa"));
    let staged = snap.staged_issuer().unwrap();
    assert_eq!(
        (staged.id.as_str(), staged.activates_at_unix_ms),
        ("p256:cc", 1_900_000_000_000)
    );
    assert!(snap.issuer_keys.iter().all(|k| k.sealed.is_empty()));
    let view = a.lease_view("none", "none").await.unwrap();
    assert_eq!(view.issuer.as_ref().unwrap().sealed, b"sealed-p256:aa");
    assert_eq!(
        a.apply(Mutation::ActivateIssuerKey {
            id: "p256:aa".into()
        })
        .await,
        Err(StoreError::NotFound("staged issuer key"))
    );
    let g3 = a
        .apply(Mutation::ActivateIssuerKey {
            id: "p256:cc".into(),
        })
        .await
        .unwrap();
    assert_eq!(g3, g2 + 1);
    assert_eq!(
        b.apply(Mutation::ActivateIssuerKey {
            id: "p256:cc".into()
        })
        .await,
        Err(StoreError::NotFound("staged issuer key"))
    );
    let keys = b.issuer_keys().await.unwrap();
    assert_eq!(keys.len(), 1, "the old key is deleted: {keys:?}");
    assert!(keys[0].active && keys[0].id == "p256:cc" && keys[0].sealed == b"sealed-p256:cc");
    assert_eq!(b.generation().await.unwrap(), g3);
    let log: Vec<String> = b
        .revisions(0, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|r| format!("{}:{}", r.kind, r.object_id))
        .collect();
    assert_eq!(
        log,
        [
            "install_issuer_key:p256:aa",
            "stage_issuer_key:p256:cc",
            "activate_issuer_key:p256:cc"
        ]
    );
}

async fn principal_limits_are_set_read_and_cleared<B: Backend>() {
    let (a, b) = B::pair().await;
    a.apply(principal("team-a")).await.unwrap();
    let limits = PrincipalLimits {
        requests_per_minute: 60,
        tokens_per_minute: 100_000,
        concurrent: 4,
        budget_per_day_micro_usd: 0,
        budget_per_month_micro_usd: 20_000_000,
        models: vec![ModelLimits {
            model: "gpt-4o".into(),
            requests_per_minute: 10,
            tokens_per_minute: 0,
            concurrent: 1,
        }],
    };
    let set = |id: &str, l: Option<PrincipalLimits>| Mutation::SetPrincipalLimits {
        id: id.into(),
        limits: l,
    };
    let g = a.apply(set("team-a", Some(limits.clone()))).await.unwrap();
    // The other handle (replica) reads what was set, at the generation it was set in.
    let snap = b.snapshot().await.unwrap();
    assert_eq!(snap.generation, g);
    assert_eq!(snap.principals[0].limits.as_ref(), Some(&limits));
    let projection = iop_cp::projection::build(&snap);
    assert_eq!(projection.principals[0].limits.as_ref(), Some(&limits));
    let revs = b.revisions(g - 1, 10).await.unwrap();
    assert_eq!(revs[0].kind, "set_principal_limits");

    // Refusals change nothing: an unknown principal, a rate the shared store cannot compute
    // exactly, a model named twice, a model that is not a wire target.
    assert_eq!(
        a.apply(set("nobody", Some(limits.clone()))).await,
        Err(StoreError::NotFound("principal"))
    );
    let mut too_fast = limits.clone();
    too_fast.tokens_per_minute = iop_cp::store::MAX_RATE_PER_MINUTE + 1;
    assert!(matches!(
        a.apply(set("team-a", Some(too_fast))).await,
        Err(StoreError::Invalid(_))
    ));
    let mut twice = limits.clone();
    twice.models.push(twice.models[0].clone());
    assert!(matches!(
        a.apply(set("team-a", Some(twice))).await,
        Err(StoreError::Invalid(_))
    ));
    let mut spaced = limits.clone();
    spaced.models[0].model = "gpt 4o".into();
    assert!(matches!(
        a.apply(set("team-a", Some(spaced))).await,
        Err(StoreError::Invalid(_))
    ));
    assert_eq!(a.generation().await.unwrap(), g);
    assert_eq!(
        b.snapshot().await.unwrap().principals[0].limits.as_ref(),
        Some(&limits)
    );

    // Cleared: the projection carries none.
    let g2 = b.apply(set("team-a", None)).await.unwrap();
    assert_eq!(g2, g + 1);
    let snap = a.snapshot().await.unwrap();
    assert_eq!(snap.principals[0].limits, None);
    assert_eq!(iop_cp::projection::build(&snap).principals[0].limits, None);
}

fn usage(id: &str, principal: &str, at_unix_ms: i64, output: u64) -> UsageRecord {
    UsageRecord {
        request_id: id.into(),
        at_unix_ms,
        principal_id: principal.into(),
        model: "gpt-4o-mini".into(),
        provider: "node-1/openai".into(),
        input_tokens: 10,
        output_tokens: output,
        cached_input_tokens: 4,
        estimated: false,
        cost_pico_usd: 1_000,
        outcome: "completed".into(),
        duration_us: 5_000,
        first_byte_us: 1_000,
        added_us: 200,
    }
}

async fn usage_is_stored_once_rolled_up_by_day_and_pruned<B: Backend>() {
    let (a, b) = B::pair().await;
    let g = a.generation().await.unwrap();
    // 2026-12-01T23:59:59.999Z and 2026-12-02T00:00:00Z: two UTC days.
    let (late, early) = (1_796_169_599_999, 1_796_169_600_000);
    assert_eq!(iop_cp::store::day_of(late), "2026-12-01");
    assert_eq!(iop_cp::store::day_of(early), "2026-12-02");
    let first = [
        usage("req-x-1", "team-a", late, 20),
        usage("req-x-2", "team-a", early, 30),
        usage("req-x-3", "team-b", early, 5),
    ];
    assert_eq!(
        a.record_usage("edge-1", &first).await.unwrap(),
        UsageStored {
            stored: 3,
            duplicates: 0
        }
    );
    // A replay through another replica (the Edge failed over before its ack): nothing twice.
    let replay = [first[1].clone(), usage("req-x-4", "team-a", early, 50)];
    assert_eq!(
        b.record_usage("edge-1", &replay).await.unwrap(),
        UsageStored {
            stored: 1,
            duplicates: 1
        }
    );
    assert_eq!(
        a.generation().await.unwrap(),
        g,
        "usage is not a mutation of the projection"
    );
    let rows = b.usage_daily(None, 100).await.unwrap();
    let key = |r: &DailyUsage| {
        (
            r.day.clone(),
            r.principal_id.clone(),
            r.requests,
            r.output_tokens,
        )
    };
    assert_eq!(
        rows.iter().map(key).collect::<Vec<_>>(),
        vec![
            ("2026-12-01".into(), "team-a".into(), 1, 20),
            ("2026-12-02".into(), "team-a".into(), 2, 80),
            ("2026-12-02".into(), "team-b".into(), 1, 5),
        ]
    );
    assert_eq!(rows[1].cached_input_tokens, 8);
    assert_eq!(rows[1].cost_pico_usd, 2_000);
    assert_eq!(
        b.usage_daily(Some("2026-12-02"), 100).await.unwrap().len(),
        2
    );
    assert_eq!(b.usage_daily(None, 1).await.unwrap().len(), 1);
    // Raw rows older than the cut go; the rollup stays, and a late replay of a pruned record
    // is stored again (retention is the replay window: keep it longer than any spool).
    assert_eq!(a.prune_usage(early).await.unwrap(), 1);
    assert_eq!(b.usage_daily(None, 100).await.unwrap(), rows);
}

macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name::<Sqlite>().await })*
        }
        mod postgres {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name::<Postgres>().await })*
        }
    };
}

contract!(
    generations_are_strict_and_logged,
    refused_mutations_change_nothing,
    tokens_slots_routes_and_revisions,
    concurrent_writers_get_distinct_generations,
    a_change_elsewhere_ends_the_wait,
    issuer_keys_install_stage_and_activate,
    principal_limits_are_set_read_and_cleared,
    usage_is_stored_once_rolled_up_by_day_and_pruned,
);

/// A store file made before principal limits existed opens, gains the column, and keeps its
/// rows (read with no limits).
#[tokio::test]
async fn sqlite_store_of_an_older_release_is_migrated() {
    let dir = std::env::temp_dir().join(format!("iop-cp-migrate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("store.sqlite3");
    {
        // The principals table as the first release created it.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
             INSERT INTO meta (k, v) VALUES ('generation', 2);
             CREATE TABLE principals (
               id TEXT PRIMARY KEY, display_name TEXT NOT NULL, enabled INTEGER NOT NULL);
             INSERT INTO principals VALUES ('team-a', 'Team A', 1);",
        )
        .unwrap();
    }
    for _ in 0..2 {
        // Opening twice: the migration is a no-op the second time.
        let store = SqliteStore::open(&path).unwrap();
        let snap = store.snapshot().await.unwrap();
        assert_eq!(snap.principals.len(), 1);
        assert_eq!(snap.principals[0].display_name, "Team A");
    }
    let store = SqliteStore::open(&path).unwrap();
    assert_eq!(store.snapshot().await.unwrap().principals[0].limits, None);
    let limits = PrincipalLimits {
        concurrent: 2,
        ..PrincipalLimits::default()
    };
    store
        .apply(Mutation::SetPrincipalLimits {
            id: "team-a".into(),
            limits: Some(limits.clone()),
        })
        .await
        .unwrap();
    assert_eq!(
        store.snapshot().await.unwrap().principals[0].limits,
        Some(limits)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
