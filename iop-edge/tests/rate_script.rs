//! The shared limits' Redis script (`iop_edge::limits::shared`, `rate.lua`) against the pure
//! rule (`iop_edge_core::ratelimit::Gcra`), side by side on generated sequences, against a real
//! Redis (`scripts/test-all.sh` starts one on a free loopback port and names it in
//! `PROXYPOOL_TEST_REDIS_URL`): every borrow's answer (allowed, units granted, remaining,
//! reset and retry-after per quantity) and, after every step, each quantity's state must be
//! the same. Time is the test's own (the script takes `now`), so the sequences cover waits of
//! any length in no time.
//!
//! The same properties run against a real Redis Cluster (`IOP_TEST_REDIS_CLUSTER_URL`, started
//! by `scripts/redis-cluster.sh`): the cluster client routes each call by its keys' hash tag.
//!
//! Checked against deliberate breaks of the script (made, run, reverted): the extra share not
//! divided by `share`, and a refund that rounds up; each fails here. The budget script
//! (`budget.lua`) is checked the same way against a pure model of its rule (break: its extra
//! not divided by `share` fails it).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::time::Duration;

use iop_edge::limits::shared::{Quantity, RateStore};
use iop_edge::ratelimit::{Gcra, Rate};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Wait(u64),
    /// Borrow `need[i]` from both quantities, `ahead[i]` more at most.
    Borrow {
        need: [u64; 2],
        ahead: [u64; 2],
        share: u64,
    },
    Charge(usize, u64),
    Refund(usize, u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..5_000_000).prop_map(Op::Wait),
        ([0u64..60, 0u64..2000], [0u64..30, 0u64..3000], 1u64..8)
            .prop_map(|(need, ahead, share)| Op::Borrow { need, ahead, share }),
        (0usize..2, 0u64..500).prop_map(|(q, u)| Op::Charge(q, u)),
        (0usize..2, 0u64..500).prop_map(|(q, u)| Op::Refund(q, u)),
    ]
}

fn rate() -> impl Strategy<Value = Rate> {
    (1u64..5000, 1u64..300)
        .prop_map(|(limit, secs)| Rate::new(limit, Duration::from_secs(secs)).unwrap())
}

/// The same store on the Redis Cluster `scripts/redis-cluster.sh` starts (three masters,
/// three replicas), named in `IOP_TEST_REDIS_CLUSTER_URL`.
fn cluster_store() -> &'static (tokio::runtime::Runtime, RateStore) {
    static STORE: std::sync::OnceLock<(tokio::runtime::Runtime, RateStore)> =
        std::sync::OnceLock::new();
    STORE.get_or_init(|| {
        let urls = std::env::var("IOP_TEST_REDIS_CLUSTER_URL").expect(
            "IOP_TEST_REDIS_CLUSTER_URL is not set: run scripts/test-all.sh (it starts a Redis \
             Cluster on free loopback ports: scripts/redis-cluster.sh)",
        );
        let seeds: Vec<String> = urls.split(',').map(str::to_owned).collect();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let prefix = format!("iop-rate-script-{}", std::process::id());
        let s = RateStore::cluster(&seeds, &prefix, Duration::from_secs(5))
            .unwrap()
            .with_linger(Duration::from_secs(3600));
        (rt, s)
    })
}

fn store() -> &'static (tokio::runtime::Runtime, RateStore) {
    static STORE: std::sync::OnceLock<(tokio::runtime::Runtime, RateStore)> =
        std::sync::OnceLock::new();
    STORE.get_or_init(|| {
        let url = std::env::var("PROXYPOOL_TEST_REDIS_URL").expect(
            "PROXYPOOL_TEST_REDIS_URL is not set: run scripts/test-all.sh (it starts redis-server \
             on a free loopback port), or point it at a Redis you can flush",
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let prefix = format!("iop-rate-script-{}", std::process::id());
        let s = RateStore::new(&url, &prefix, Duration::from_secs(5))
            .unwrap()
            .with_linger(Duration::from_secs(3600));
        (rt, s)
    })
}

fn run(cluster: bool, rates: [Rate; 2], ops: Vec<Op>) {
    static CASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let (rt, s) = if cluster { cluster_store() } else { store() };
    let id = format!(
        "case-{}",
        CASE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let keys = [s.key(&id, None, 'r'), s.key(&id, Some("m"), 't')];
    let mut pure = [Gcra::default(); 2];
    let mut now = 1_767_225_600_000_000u64;
    let q = |i: usize, units: u64, ahead: u64, share: u64| Quantity {
        key: keys[i].clone(),
        rate: rates[i],
        units,
        ahead,
        share,
    };
    rt.block_on(async {
        for op in ops {
            match op {
                Op::Wait(us) => now += us,
                Op::Borrow { need, ahead, share } => {
                    let got = s
                        .borrow(
                            &[
                                q(0, need[0], ahead[0], share),
                                q(1, need[1], ahead[1], share),
                            ],
                            Some(now),
                        )
                        .await
                        .unwrap();
                    assert_eq!(got.now_us, now);
                    let checks: Vec<_> = (0..2)
                        .map(|i| pure[i].check(&rates[i], now, need[i]))
                        .collect();
                    let allowed = checks.iter().all(|d| d.allowed);
                    assert_eq!(got.allowed, allowed, "{op:?}");
                    for i in 0..2 {
                        let expected = if allowed {
                            let (granted, d) = pure[i]
                                .borrow(&rates[i], now, need[i], ahead[i], share)
                                .unwrap();
                            (granted, d)
                        } else {
                            (0, checks[i])
                        };
                        assert_eq!(got.quantities[i], expected, "quantity {i} of {op:?}");
                    }
                }
                Op::Charge(i, units) => {
                    s.charge(&[q(i, units, 0, 1)], Some(now)).await.unwrap();
                    pure[i].charge(&rates[i], now, units);
                }
                Op::Refund(i, units) => {
                    s.refund(&[q(i, units, 0, 1)], Some(now)).await.unwrap();
                    pure[i].refund(&rates[i], units);
                }
            }
            for i in 0..2 {
                // A key at rest is deleted; the pure state may hold a TAT in the past: the
                // same state.
                let stored = s.tat(&keys[i]).await.unwrap();
                assert_eq!(
                    stored.max(now),
                    pure[i].tat_us().max(now),
                    "state of quantity {i}"
                );
            }
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_script_decides_as_the_pure_rule(
        r0 in rate(),
        r1 in rate(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run(false, [r0, r1], ops);
    }

    /// The same on a Redis Cluster: each call's keys share the key id's slot.
    #[test]
    fn the_script_decides_as_the_pure_rule_on_a_cluster(
        r0 in rate(),
        r1 in rate(),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        run(true, [r0, r1], ops);
    }
}

#[test]
fn every_rate_the_edge_accepts_is_exact_in_lua() {
    use iop_edge::limits::shared::exact_in_lua;
    assert!(exact_in_lua(&Rate::per_minute(150_000_000).unwrap()));
    assert!(!exact_in_lua(&Rate::per_minute(151_000_000).unwrap()));
}

// === Shared budgets (`budget.lua`) ===

#[derive(Clone, Debug)]
enum BudgetOp {
    Take {
        need: u64,
        covered: u64,
        ahead: u64,
        share: u64,
    },
    Settle {
        give: u64,
        spend: u64,
        force: u64,
    },
}

fn budget_op(scale: u64) -> impl Strategy<Value = BudgetOp> {
    prop_oneof![
        (0..scale / 4, 0..scale / 8, 0..scale / 8, 1u64..8).prop_map(
            |(need, covered, ahead, share)| BudgetOp::Take {
                need,
                covered,
                ahead,
                share,
            }
        ),
        (0..scale / 4, 0..scale / 4, 0..scale / 20)
            .prop_map(|(give, spend, force)| BudgetOp::Settle { give, spend, force }),
    ]
}

/// The budget store's rule, in Rust: per period (0 budget: none), `charged` and `spent`
/// (indexed by period, as the script is).
#[derive(Clone, Copy, Debug, Default)]
struct PureBudget {
    charged: [u64; 2],
    spent: [u64; 2],
}

#[allow(
    clippy::needless_range_loop,
    reason = "periods by index, as in the script"
)]
impl PureBudget {
    fn take(
        &mut self,
        budgets: [u64; 2],
        need: u64,
        whole: u64,
        ahead: u64,
        share: u64,
    ) -> BudgetTake {
        let mut extra = ahead;
        for i in 0..2 {
            let b = budgets[i];
            if b == 0 {
                continue;
            }
            if self.spent[i] + whole > b {
                return BudgetTake::Exhausted(if i == 0 { "day" } else { "month" });
            }
            if self.charged[i] + need > b {
                return BudgetTake::Held;
            }
            extra = extra.min((b - self.charged[i] - need) / share);
        }
        for i in 0..2 {
            if budgets[i] > 0 {
                self.charged[i] += need + extra;
            }
        }
        BudgetTake::Granted(need + extra)
    }

    fn settle(&mut self, budgets: [u64; 2], give: u64, spend: u64, force: u64) {
        for i in 0..2 {
            if budgets[i] > 0 {
                self.charged[i] = (self.charged[i] + force).saturating_sub(give);
                self.spent[i] += spend;
            }
        }
    }
}

use iop_edge::limits::shared::BudgetTake;

fn run_budget(cluster: bool, budgets: [u64; 2], ops: Vec<BudgetOp>) {
    static CASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let (rt, s) = if cluster { cluster_store() } else { store() };
    let id = format!(
        "budget-{}",
        CASE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let mut pure = PureBudget::default();
    rt.block_on(async {
        for op in ops {
            match op {
                BudgetOp::Take {
                    need,
                    covered,
                    ahead,
                    share,
                } => {
                    let whole = need + covered;
                    let got = s
                        .budget_take(
                            &id,
                            "2026-12-02",
                            "2026-12",
                            need,
                            whole,
                            ahead,
                            share,
                            budgets,
                        )
                        .await
                        .unwrap();
                    assert_eq!(got, pure.take(budgets, need, whole, ahead, share), "{op:?}");
                }
                BudgetOp::Settle { give, spend, force } => {
                    s.budget_settle(&id, "2026-12-02", "2026-12", give, spend, force, budgets)
                        .await
                        .unwrap();
                    pure.settle(budgets, give, spend, force);
                }
            }
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Budgets from cents to millions of dollars (nano-dollars up to 2×10^15, near the 2^53
    /// a Lua number holds exactly).
    #[test]
    fn the_budget_script_decides_as_the_pure_rule(
        cluster in any::<bool>(),
        scale in prop_oneof![Just(10_000_000u64), Just(2_000_000_000_000_000u64)],
        day_on in any::<bool>(),
        month_on in any::<bool>(),
        ops in prop::collection::vec(budget_op(2_000_000_000_000_000), 1..40),
    ) {
        let budgets = [
            if day_on { scale / 2 } else { 0 },
            if month_on { scale } else { 0 },
        ];
        let ops = ops
            .into_iter()
            .map(|op| match op {
                BudgetOp::Take {
                    need,
                    covered,
                    ahead,
                    share,
                } => BudgetOp::Take {
                    need: need % (scale / 4).max(1),
                    covered: covered % (scale / 8).max(1),
                    ahead: ahead % (scale / 8).max(1),
                    share,
                },
                BudgetOp::Settle { give, spend, force } => BudgetOp::Settle {
                    give: give % (scale / 4).max(1),
                    spend: spend % (scale / 4).max(1),
                    force: force % (scale / 20).max(1),
                },
            })
            .collect();
        run_budget(cluster, budgets, ops);
    }
}
