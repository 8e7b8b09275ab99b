//! Unit tests of the pool: selection, leases, the queue and the overlay.

use std::collections::HashSet;

use proptest::prelude::*;

use super::*;

const NODES: [&str; 3] = ["n0", "n1", "n2"];

fn spec(node: &str, id: &str, capacity: u32, long: u32) -> ProviderSpec {
    ProviderSpec {
        key: ProviderKey {
            node_id: node.into(),
            provider_id: id.into(),
        },
        adapter: "a".into(),
        target: "t".into(),
        kind: if node == "n1" {
            ProviderKind::Native
        } else {
            ProviderKind::OpenAiCompat
        },
        category: "api".into(),
        capacity,
        long_context_capacity: long,
        response_stall_timeout: Duration::from_secs(30),
        enabled: true,
    }
}

/// Two models over three Nodes; model "m" spans all of them (mixed kinds), "solo" one.
fn pool(max_queue: usize) -> Pool {
    let providers = vec![
        spec("n0", "p0", 2, 1),
        spec("n1", "p1", 1, 0),
        spec("n2", "p2", 3, 2),
    ];
    let all = providers.iter().map(|p| p.key.clone()).collect();
    let solo = vec![providers[1].key.clone()];
    Pool::new(PoolConfig {
        providers,
        models: vec![("m".into(), all), ("solo".into(), solo)],
        max_queue,
    })
}

#[derive(Clone, Debug)]
enum Op {
    Submit { solo: bool, long: bool },
    Release(usize),
    Cancel(usize),
    Ready(usize),
    Fence(usize),
    Unavailable(usize),
    Recover(usize),
    Exclude(usize, bool),
    Tick(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (any::<bool>(), any::<bool>()).prop_map(|(solo, long)| Op::Submit { solo, long }),
        4 => (0usize..16).prop_map(Op::Release),
        1 => (0usize..16).prop_map(Op::Cancel),
        2 => (0usize..3).prop_map(Op::Ready),
        1 => (0usize..3).prop_map(Op::Fence),
        1 => (0usize..3).prop_map(Op::Unavailable),
        1 => (0usize..3).prop_map(Op::Recover),
        1 => (0usize..3, any::<bool>()).prop_map(|(n, e)| Op::Exclude(n, e)),
        1 => (0u64..3000).prop_map(Op::Tick),
    ]
}

/// The test's own view of provider `i` (on node `i`): capacity `(total, long)`, the
/// candidates of each model, from [`pool`]'s configuration.
const CAPACITY: [(u32, u32); 3] = [(2, 1), (1, 0), (3, 2)];

fn candidates(solo: bool) -> &'static [usize] {
    if solo { &[1] } else { &[0, 1, 2] }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Against the test's own model (not the pool's snapshot): leases are released exactly
    /// once; a provider is offline exactly when its Node has no ready generation and
    /// unavailable exactly while an overlay for the current generation is set or its Node is
    /// excluded (until its next ready generation); no waiter is
    /// stranded while one of its candidates has room by the model's count; and waiters of
    /// one kind are served first come, first served.
    #[test]
    fn leases_never_leak_or_double_release_and_no_waiter_is_stranded(ops in proptest::collection::vec(op(), 0..120)) {
        let start = Instant::now();
        let mut now = start;
        let mut p = pool(8);
        let mut generation = [None::<Generation>; 3];
        let mut unavailable = [false; 3];
        let mut excluded = [false; 3];
        let mut next_gen = 1u64;
        // Held leases: id → (provider index, long).
        let mut active: Vec<(LeaseId, usize, bool)> = Vec::new();
        let mut released: HashSet<LeaseId> = HashSet::new();
        // Waiters in submission order, with their kind.
        let mut waiting: Vec<(RequestId, bool, bool)> = Vec::new();
        let index = |key: &ProviderKey| NODES.iter().position(|n| *n == key.node_id).unwrap();
        for op in ops {
            let mut granted: Vec<(RequestId, bool, bool)> = Vec::new();
            match op {
                Op::Submit { solo, long } => {
                    let model = if solo { "solo" } else { "m" };
                    match p.submit(now, model, long, Duration::from_millis(1000)) {
                        Ok(Submitted::Granted(l)) => {
                            // First come, first served: never ahead of a waiter of its kind.
                            prop_assert!(
                                !waiting.iter().any(|w| (w.1, w.2) == (solo, long)),
                                "granted ahead of an earlier waiter of its kind"
                            );
                            prop_assert!(candidates(solo).contains(&index(&l.key)));
                            prop_assert!(!excluded[index(&l.key)], "granted on an excluded Node");
                            active.push((l.id, index(&l.key), long));
                        }
                        Ok(Submitted::Queued(r)) => waiting.push((r, solo, long)),
                        Err(PoolError::QueueFull) => prop_assert_eq!(waiting.len(), 8),
                        Err(e) => panic!("{e:?}"),
                    }
                }
                Op::Release(i) => {
                    if !active.is_empty() {
                        let (id, _, _) = active.remove(i % active.len());
                        prop_assert!(p.release(id), "first release of a live lease releases it");
                        prop_assert!(!p.release(id), "second release is a no-op");
                        released.insert(id);
                    }
                }
                Op::Cancel(i) => {
                    if !waiting.is_empty() {
                        let (r, _, _) = waiting.remove(i % waiting.len());
                        prop_assert!(p.cancel(r));
                        prop_assert!(!p.cancel(r));
                    }
                }
                Op::Ready(n) => {
                    if let Some(g) = generation[n] {
                        // A newer connection supersedes: the old generation is fenced first.
                        for id in p.node_fenced(NODES[n], g) {
                            prop_assert!(active.iter().any(|a| a.0 == id && a.1 == n));
                            active.retain(|a| a.0 != id);
                            prop_assert!(released.insert(id));
                        }
                    }
                    let g = Generation(next_gen);
                    next_gen += 1;
                    generation[n] = Some(g);
                    unavailable[n] = false;
                    excluded[n] = false;
                    p.node_ready(NODES[n], g);
                }
                Op::Fence(n) => {
                    if let Some(g) = generation[n].take() {
                        let mut expected: Vec<LeaseId> =
                            active.iter().filter(|a| a.1 == n).map(|a| a.0).collect();
                        expected.sort();
                        let got = p.node_fenced(NODES[n], g);
                        prop_assert_eq!(&got, &expected, "a fence releases exactly that Node's leases");
                        for id in got {
                            active.retain(|a| a.0 != id);
                            prop_assert!(released.insert(id), "no lease is released twice");
                            prop_assert!(!p.release(id), "the run's own terminal after a fence is a no-op");
                        }
                        unavailable[n] = false;
                        // A stale fence changes nothing.
                        prop_assert!(p.node_fenced(NODES[n], g).is_empty());
                    }
                }
                Op::Unavailable(n) => {
                    let key = ProviderKey { node_id: NODES[n].into(), provider_id: format!("p{n}") };
                    // Only for the current generation; a stale one is ignored.
                    let stale = Generation(next_gen + 100);
                    prop_assert!(!p.set_unavailable(&key, stale));
                    if let Some(g) = generation[n] {
                        prop_assert!(p.set_unavailable(&key, g));
                        unavailable[n] = true;
                    }
                }
                Op::Recover(n) => {
                    let key = ProviderKey { node_id: NODES[n].into(), provider_id: format!("p{n}") };
                    let cleared = generation[n].is_some_and(|g| p.clear_unavailable(&key, g));
                    prop_assert_eq!(cleared, unavailable[n] && generation[n].is_some());
                    unavailable[n] = false;
                }
                Op::Exclude(n, e) => {
                    prop_assert_eq!(p.set_node_excluded(NODES[n], e), excluded[n] != e);
                    excluded[n] = e;
                }
                Op::Tick(ms) => {
                    now += Duration::from_millis(ms);
                    p.handle_timeout(now);
                }
            }
            while let Some(ev) = p.poll_event() {
                match ev {
                    PoolEvent::Granted { request, lease } => {
                        let Some(at) = waiting.iter().position(|w| w.0 == request) else {
                            prop_assert!(false, "granted a request that is not waiting");
                            unreachable!()
                        };
                        let (_, solo, long) = waiting.remove(at);
                        let n = index(&lease.key);
                        prop_assert!(candidates(solo).contains(&n), "granted outside its model");
                        prop_assert!(generation[n] == Some(lease.generation) && !unavailable[n] && !excluded[n]);
                        active.push((lease.id, n, long));
                        granted.push((request, solo, long));
                    }
                    PoolEvent::WaitTimedOut { request } => {
                        prop_assert!(waiting.iter().any(|w| w.0 == request));
                        waiting.retain(|w| w.0 != request);
                    }
                }
            }
            // First come, first served within a kind: nobody granted now was behind a waiter
            // of its kind that is still waiting.
            for (r, solo, long) in &granted {
                prop_assert!(
                    !waiting.iter().any(|w| (w.1, w.2) == (*solo, *long) && w.0 < *r),
                    "{:?} granted while an earlier waiter of its kind waits", r
                );
            }
            // Leases and figures, against the model.
            prop_assert_eq!(p.lease_count(), active.len());
            prop_assert_eq!(p.queue_len(), waiting.len());
            let snap = p.snapshot();
            let in_flight = |n: usize| -> (u32, u32) {
                let held = active.iter().filter(|a| a.1 == n);
                (held.clone().count() as u32, held.filter(|a| a.2).count() as u32)
            };
            for (n, s) in snap.iter().enumerate() {
                let (total, long) = in_flight(n);
                prop_assert!(total <= CAPACITY[n].0 && long <= CAPACITY[n].1, "over capacity");
                match (generation[n], unavailable[n] || excluded[n]) {
                    (None, _) => {
                        prop_assert_eq!(total, 0);
                        prop_assert_eq!((s.health.as_str(), s.status.as_str(), s.capacity, s.in_flight, s.queued), ("offline", "unavailable", 0, 0, 0));
                    }
                    (Some(_), true) => {
                        prop_assert_eq!((s.health.as_str(), s.status.as_str()), ("unavailable", "unavailable"));
                        if excluded[n] && !unavailable[n] {
                            prop_assert_eq!((s.in_flight, s.long_in_flight), (total, long), "an excluded Node's running requests are shown");
                        }
                    }
                    (Some(_), false) => {
                        prop_assert_eq!((s.health.as_str(), s.status.as_str()), ("healthy", "available"));
                        prop_assert_eq!((s.capacity, s.in_flight, s.long_in_flight), (CAPACITY[n].0, total, long));
                    }
                }
            }
            // No waiter stranded while one of its live candidates has room for it (by the
            // model's own count).
            for (r, solo, long) in &waiting {
                let room = candidates(*solo).iter().any(|&n| {
                    let (total, l) = in_flight(n);
                    generation[n].is_some() && !unavailable[n] && !excluded[n] && total < CAPACITY[n].0 && (!long || l < CAPACITY[n].1)
                });
                prop_assert!(!room, "waiter {:?} stranded with free capacity", r);
            }
        }
    }
}

#[test]
fn snapshot_figures_follow_the_seed() {
    let t = Instant::now();
    let mut p = pool(8);
    // Configured but never connected: offline, all zero.
    assert!(
        p.snapshot()
            .iter()
            .all(|s| s.health == "offline" && s.capacity == 0)
    );
    assert_eq!(
        p.submit(t, "nope", false, Duration::ZERO),
        Err(PoolError::UnknownModel)
    );
    p.node_ready("n1", Generation(1));
    let Ok(Submitted::Granted(l)) = p.submit(t, "solo", false, Duration::from_secs(1)) else {
        panic!()
    };
    assert_eq!(
        (l.kind, l.response_stall_timeout),
        (ProviderKind::Native, Duration::from_secs(30))
    );
    // Capacity 1 is taken: the next two wait; both count as pressure on p1 and on p1 only.
    assert!(matches!(
        p.submit(t, "solo", false, Duration::from_secs(1)),
        Ok(Submitted::Queued(_))
    ));
    assert!(matches!(
        p.submit(t, "m", false, Duration::from_secs(1)),
        Ok(Submitted::Queued(_))
    ));
    let s = p.snapshot();
    assert_eq!(
        (s[1].in_flight, s[1].queued, s[1].status.as_str()),
        (1, 2, "available")
    );
    // A Node becoming ready pumps the waiter of model "m" onto it.
    p.node_ready("n0", Generation(2));
    assert!(
        matches!(p.poll_event(), Some(PoolEvent::Granted { lease, .. }) if lease.key.node_id == "n0")
    );
    // Overlay: unavailable, all figures zero, identity kept; not inherited by a new generation.
    assert!(p.set_unavailable(&l.key, Generation(1)));
    let s = p.snapshot();
    assert_eq!(
        (
            s[1].status.as_str(),
            s[1].health.as_str(),
            s[1].capacity,
            s[1].provider_id.as_str()
        ),
        ("unavailable", "unavailable", 0, "p1")
    );
    assert!(
        !p.set_unavailable(&l.key, Generation(9)),
        "only the current generation"
    );
    assert_eq!(p.node_fenced("n1", Generation(1)), vec![l.id]);
    p.node_ready("n1", Generation(3));
    let s = p.snapshot();
    assert_eq!((s[1].health.as_str(), s[1].capacity), ("healthy", 1));
    // The waiter was granted on the new generation as soon as it was ready.
    assert!(
        matches!(p.poll_event(), Some(PoolEvent::Granted { lease, .. }) if lease.generation == Generation(3))
    );
}

/// Seed 000: a provider's `queued` is the number of distinct waiting requests that count it as
/// a live candidate, and `long_queued` those of them that are long: one waiting request shows
/// as pressure on every live candidate of its model, and on no provider that is not live.
#[test]
fn queued_is_candidate_pressure_on_every_live_candidate() {
    let t = Instant::now();
    let mut p = pool(8);
    // n0 (p0: capacity 2, long 1) and n2 (p2: 3, long 2) are ready, n1 (p1) is not: model m's
    // live candidates are p0 and p2. Fill both.
    p.node_ready("n0", Generation(1));
    p.node_ready("n2", Generation(2));
    for _ in 0..5 {
        assert!(matches!(
            p.submit(t, "m", false, Duration::from_secs(1)),
            Ok(Submitted::Granted(_))
        ));
    }
    // One short and one long request wait for m; one request waits for "solo" (p1 only).
    for long in [false, true] {
        assert!(matches!(
            p.submit(t, "m", long, Duration::from_secs(1)),
            Ok(Submitted::Queued(_))
        ));
    }
    assert!(matches!(
        p.submit(t, "solo", false, Duration::from_secs(1)),
        Ok(Submitted::Queued(_))
    ));
    let s = p.snapshot();
    let figures = |i: usize| (s[i].provider_id.as_str(), s[i].queued, s[i].long_queued);
    // Both requests for m on both live candidates (so the sum over providers, 4, is more than
    // the 3 requests waiting); the solo waiter on no one, since p1 is not live.
    assert_eq!(figures(0), ("p0", 2, 1));
    assert_eq!(figures(2), ("p2", 2, 1));
    assert_eq!(figures(1), ("p1", 0, 0));
}

#[test]
fn full_queue_and_wait_timeout_are_errors_not_hangs() {
    let t = Instant::now();
    let mut p = pool(2);
    for _ in 0..2 {
        assert!(matches!(
            p.submit(t, "m", false, Duration::from_millis(500)),
            Ok(Submitted::Queued(_))
        ));
    }
    assert_eq!(
        p.submit(t, "m", false, Duration::from_millis(500)),
        Err(PoolError::QueueFull)
    );
    assert_eq!(p.poll_timeout(), Some(t + Duration::from_millis(500)));
    p.handle_timeout(t + Duration::from_millis(500));
    assert!(matches!(
        p.poll_event(),
        Some(PoolEvent::WaitTimedOut { .. })
    ));
    assert!(matches!(
        p.poll_event(),
        Some(PoolEvent::WaitTimedOut { .. })
    ));
    assert_eq!(p.queue_len(), 0);
}
