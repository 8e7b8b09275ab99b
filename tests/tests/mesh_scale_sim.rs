//! Many Edges and many Nodes, each Node serving two Edges, in one process on `turmoil`'s
//! simulated network and clock: the deployment of issue #32 at a size that real processes
//! cannot reach on two cores (an Edge and a Node per process, hundreds of them), for the
//! capacity model in `benches/README.md`.
//!
//! Real parts: every Edge is the real transport with its provider pool (`start_unbound`, its
//! connections served by `EdgeHandle::serve_connection`); every Node is the real Node
//! (`iop_node::run_node_dialing`: one supervisor per Edge, mTLS, the session driver, the
//! capacity gate shared by both sessions) with an embedder's adapter (the public [`Adapter`]
//! trait) that answers a raw tunnel in 150 ms of simulated time and counts how many it runs at
//! once. Node `i` serves Edges `i mod E` and `i + 1 mod E`; every Edge's pool holds each of its
//! Nodes at the adapter's whole capacity, so two Edges can send a Node twice what it admits.
//!
//! The run, for `MESH_SCALE_EDGES` Edges (default 4) and `MESH_SCALE_NODES` Nodes (default 24):
//!
//! 1. every Node becomes ready on both its Edges;
//! 2. clients on every Edge keep every Node busy (as many clients per Edge as its Nodes'
//!    capacity, each sending tunnels one after another through the pool); a tunnel that the
//!    Node refuses for capacity is sent again after a short pause, as the Edge's HTTP layer
//!    does;
//! 3. one second in, the host of Edge 0 crashes; two seconds later its software starts again.
//!
//! Checked:
//!
//! - **capacity**: no Node ever runs more tunnels than its capacity, although two Edges admit
//!   onto it at once; and the contention is real (some Node was refused for capacity, some Node
//!   ran at its whole capacity);
//! - **no loss on the surviving Edges**: every tunnel sent through an Edge that did not crash
//!   completes; the Nodes keep their sessions with those Edges (the same ready generation
//!   before and after the crash: no reconnect);
//! - **recovery**: every Node of the crashed Edge is ready on its new incarnation within 5 s
//!   of simulated time of its restart (the reconnect interval is 1 s).
//!
//! It prints the figures the capacity model quotes (time to all ready, tunnels completed,
//! refusals, lost with the crashed Edge, time back), in simulated time, and the wall time the
//! simulation took. Does it catch a bug? With each Node session given a capacity gate of its
//! own instead of the shared one (made, run, reverted), the capacity check fails at once: a
//! Node ran 8 tunnels at once at capacity 4.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use iop_edge::pool::{ContextSize, PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::registry::Generation;
use iop_edge::{Dispatched, EdgeHandle, PoolRequest, TransportConfig, TunnelEvent, start_unbound};
use iop_node::{
    Adapter, AdapterError, AdapterRegistry, NodeOptions, ReconnectPolicy, RunCompletion, RunEvents,
    TunnelSink, async_trait, run_node_dialing,
};
use iop_tests::pki::Ca;
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, NodeConfigPayload, ProviderStatus, ProviderTunnelRequest,
    RunRequest,
};
use iop_wire::tunnel_order::Delivery;
use iop_wire::validate::ResponseStallTimeout;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const PORT: u16 = 7000;
/// The adapter's capacity at each Node.
const CAPACITY: u32 = 4;
/// Each Edge client's tunnels, one after another.
const PER_CLIENT: usize = 12;
const CRASH_AT: Duration = Duration::from_secs(1);
const DOWN_FOR: Duration = Duration::from_secs(2);

fn env(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn edge_name(k: usize) -> String {
    format!("edge-{k}")
}

fn node_name(i: usize) -> String {
    format!("node-{i}")
}

/// The two Edges Node `i` serves.
fn edges_of(i: usize, edges: usize) -> [usize; 2] {
    [i % edges, (i + 1) % edges]
}

/// Tunnels running at each Node's adapter now, and the most at once.
struct Counters {
    now: Vec<AtomicU32>,
    most: Vec<AtomicU32>,
}

/// The provider behind every Node: status 200, three chunks 50 ms apart, a usage observation.
struct CountingTunnel {
    node: usize,
    counters: Arc<Counters>,
}

struct Running<'a>(&'a AtomicU32);
impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[async_trait]
impl Adapter for CountingTunnel {
    async fn run(&self, _: RunRequest, _: RunEvents) -> Result<RunCompletion, AdapterError> {
        Err(AdapterError::Unsupported)
    }

    async fn tunnel(
        &self,
        _: ProviderTunnelRequest,
        frames: TunnelSink,
    ) -> Result<(), AdapterError> {
        let now = &self.counters.now[self.node];
        let running = now.fetch_add(1, Ordering::Relaxed) + 1;
        let _guard = Running(now);
        self.counters.most[self.node].fetch_max(running, Ordering::Relaxed);
        iop_tests::node::answer_in_chunks(&frames, Duration::from_millis(50), false).await
    }

    async fn probe(
        &self,
        _target: &str,
        _credential: Option<&iop_node::credential::UpstreamCredential>,
    ) -> ProviderStatus {
        ProviderStatus::Available
    }
}

fn node_config() -> NodeConfigPayload {
    NodeConfigPayload {
        adapters: vec![AdapterConfig {
            name: "work".into(),
            adapter_type: "counting".into(),
            enabled: true,
            capacity: CAPACITY,
            long_context_capacity: 0,
            targets: vec!["work-model".into()],
            settings: AdapterSettings::None,
        }],
        revision: 1,
        ..Default::default()
    }
}

/// Model `w` on every Node of the Edge, each at the adapter's whole capacity.
fn pool(nodes: &[usize]) -> PoolConfig {
    let providers: Vec<ProviderSpec> = nodes
        .iter()
        .map(|&i| ProviderSpec {
            key: ProviderKey {
                node_id: node_name(i),
                provider_id: format!("{}-work", node_name(i)),
            },
            adapter: "work".into(),
            target: "work-model".into(),
            kind: ProviderKind::OpenAiCompat,
            category: "local_inference".into(),
            capacity: CAPACITY,
            long_context_capacity: 0,
            response_stall_timeout: Duration::from_secs(3),
            enabled: true,
        })
        .collect();
    let models = vec![(
        "w".to_owned(),
        providers.iter().map(|p| p.key.clone()).collect(),
    )];
    PoolConfig {
        providers,
        models,
        max_queue: 4096,
    }
}

fn tunnel(id: String) -> ProviderTunnelRequest {
    ProviderTunnelRequest {
        run_id: id,
        adapter: "work".into(),
        target: "work-model".into(),
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        body: Bytes::from_static(b"{}"),
        stream: true,
        response_stall_timeout: ResponseStallTimeout::from_duration(Duration::from_secs(3))
            .unwrap(),
        ..Default::default()
    }
}

/// Each Edge host's software as the clients find it: `None` while the host is down.
#[derive(Default)]
struct EdgeSlot {
    handle: Option<EdgeHandle>,
}

type Slots = Rc<RefCell<Vec<EdgeSlot>>>;

fn edge_host(
    ca: &Ca,
    k: usize,
    nodes: Vec<usize>,
    slots: Slots,
) -> impl Fn() -> std::pin::Pin<Box<dyn Future<Output = turmoil::Result> + 'static>> + 'static {
    let tls = iop_tests::pki::edge_server_tls(ca, &edge_name(k));
    move || {
        let (tls, slots, nodes) = (tls.clone(), slots.clone(), nodes.clone());
        Box::pin(async move {
            let mut cfg = TransportConfig::new(([0, 0, 0, 0], PORT).into(), tls);
            cfg.node_configs = nodes
                .iter()
                .map(|&i| (node_name(i), node_config()))
                .collect();
            cfg.pool = Some(pool(&nodes));
            let edge = start_unbound(cfg);
            let listener = turmoil::net::TcpListener::bind(("0.0.0.0", PORT)).await?;
            slots.borrow_mut()[k].handle = Some(edge.clone());
            while let Ok((stream, peer)) = listener.accept().await {
                edge.serve_connection(stream, peer).await;
            }
            Ok(())
        })
    }
}

fn node_host(
    ca: &Ca,
    i: usize,
    edges: usize,
    counters: Arc<Counters>,
) -> impl Fn() -> std::pin::Pin<Box<dyn Future<Output = turmoil::Result> + 'static>> + 'static {
    let name = node_name(i);
    let targets: Vec<(String, Arc<rustls::ClientConfig>)> = edges_of(i, edges)
        .iter()
        .map(|&k| {
            let tls = iop_tests::pki::node_client_tls(ca, role::NODE, &name, &edge_name(k));
            (format!("{}:{PORT}", edge_name(k)), tls)
        })
        .collect();
    move || {
        let (name, targets, counters) = (name.clone(), targets.clone(), counters.clone());
        Box::pin(async move {
            let mut adapters = AdapterRegistry::with_builtins();
            adapters.register(
                "counting",
                Arc::new(move |_: &AdapterConfig| {
                    Ok(Arc::new(CountingTunnel {
                        node: i,
                        counters: counters.clone(),
                    }) as Arc<dyn Adapter>)
                }),
            );
            let (first, rest) = targets.split_first().unwrap();
            let mut opts = NodeOptions::new(&name, &first.0, "localhost", first.1.clone())
                .unwrap()
                .with_adapters(adapters)
                .with_reconnect(ReconnectPolicy::from_config(Some(1), Some(0)).unwrap());
            for (address, tls) in rest {
                opts = opts.with_edge(address, "localhost", tls.clone()).unwrap();
            }
            opts.jitter_seed = Some(i as u64);
            run_node_dialing(opts, CancellationToken::new(), |address: &str| {
                let (host, port) = address.rsplit_once(':').unwrap();
                turmoil::net::TcpStream::connect((host.to_owned(), port.parse::<u16>().unwrap()))
            })
            .await;
            Ok(())
        })
    }
}

/// What the clients saw.
#[derive(Debug, Default)]
struct Outcome {
    /// Simulated time until every Node was ready on both its Edges.
    all_ready: Option<Duration>,
    /// Completed through Edges that never crashed / through the crashed Edge before its crash.
    completed: usize,
    completed_crashed_edge: usize,
    /// Node refusals for capacity, each followed by a retry.
    refused_for_capacity: usize,
    /// Tunnels in flight on the crashed Edge when it crashed (lost with its process).
    lost_with_crashed_edge: usize,
    /// Failures on a surviving Edge (must stay empty).
    failures: Vec<String>,
    /// Simulated time from the crashed Edge's restart to all its Nodes ready on it.
    back_after_restart: Option<Duration>,
    /// Ready generations on the surviving Edges, before the crash and at the end.
    generations_before: BTreeMap<(usize, String), Generation>,
    generations_after: BTreeMap<(usize, String), Generation>,
}

fn all_ready(edge: &EdgeHandle, want: usize) -> bool {
    edge.ready_nodes().len() == want
}

/// How one attempt at a tunnel ended.
enum Attempt {
    Completed,
    /// The Node refused it for capacity (or its connection ended first): nothing reached the
    /// provider, so it may be sent again.
    Unanswered,
}

async fn attempt(edge: EdgeHandle, id: String) -> Result<Attempt, String> {
    let dispatched = edge
        .dispatch(
            "w",
            ContextSize::Standard,
            Duration::from_secs(30),
            PoolRequest::Tunnel(tunnel(id)),
        )
        .await;
    let mut stream = match dispatched {
        Ok(Dispatched::Tunnel(s)) => s,
        Ok(Dispatched::Run(_)) => unreachable!("a tunnel"),
        Err(e) => return Err(format!("dispatch: {e:?}")),
    };
    if stream.unanswered().await.is_some() {
        return Ok(Attempt::Unanswered);
    }
    let mut ended = None;
    while let Some(ev) = stream.next().await {
        if ev.is_terminal() {
            ended = Some(ev);
        }
    }
    match ended {
        Some(TunnelEvent::Frame(Delivery::End { .. })) => Ok(Attempt::Completed),
        other => Err(format!("ended with {other:?}")),
    }
}

/// Resolves once Edge 0's host has crashed (its clients go with it).
async fn crash_of(crashed: Rc<std::cell::Cell<bool>>) {
    while !crashed.get() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One client of Edge `k`: `PER_CLIENT` tunnels one after another through the pool.
async fn client(
    k: usize,
    c: usize,
    slots: Slots,
    crashed: Rc<std::cell::Cell<bool>>,
    out: Rc<RefCell<Outcome>>,
) {
    let crashes = k == 0;
    for r in 0..PER_CLIENT {
        let id = format!("e{k}-c{c}-r{r}");
        loop {
            let edge = slots.borrow()[k].handle.clone();
            let Some(edge) = edge.filter(|_| !(crashes && crashed.get())) else {
                return;
            };
            let result = if crashes {
                tokio::select! {
                    r = attempt(edge, id.clone()) => r,
                    () = crash_of(crashed.clone()) => {
                        out.borrow_mut().lost_with_crashed_edge += 1;
                        return;
                    }
                }
            } else {
                attempt(edge, id.clone()).await
            };
            match result {
                Ok(Attempt::Completed) => {
                    let mut o = out.borrow_mut();
                    if crashes {
                        o.completed_crashed_edge += 1;
                    } else {
                        o.completed += 1;
                    }
                    break;
                }
                Ok(Attempt::Unanswered) => {
                    // Sent again after a short pause, as the Edge's HTTP layer does.
                    out.borrow_mut().refused_for_capacity += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(_) if crashes => {
                    out.borrow_mut().lost_with_crashed_edge += 1;
                    return;
                }
                Err(e) => {
                    out.borrow_mut().failures.push(format!("{id}: {e}"));
                    return;
                }
            }
        }
    }
}

struct Figures {
    outcome: Outcome,
    most: Vec<u32>,
    wall: Duration,
    simulated: Duration,
}

fn simulate(edges: usize, nodes: usize) -> Figures {
    assert!(edges >= 2, "each Node serves two Edges");
    let started = Instant::now();
    let ca = Ca::new("scale sim CA");
    let mut sim = turmoil::Builder::new()
        .simulation_duration(Duration::from_secs(600))
        .rng_seed(1)
        .tick_duration(Duration::from_millis(10))
        .build();
    let counters = Arc::new(Counters {
        now: (0..nodes).map(|_| AtomicU32::new(0)).collect(),
        most: (0..nodes).map(|_| AtomicU32::new(0)).collect(),
    });
    let of_edge: Vec<Vec<usize>> = (0..edges)
        .map(|k| {
            (0..nodes)
                .filter(|&i| edges_of(i, edges).contains(&k))
                .collect()
        })
        .collect();
    let slots: Slots = Rc::new(RefCell::new(
        (0..edges).map(|_| EdgeSlot::default()).collect(),
    ));
    for (k, served) in of_edge.iter().enumerate() {
        sim.host(
            edge_name(k),
            edge_host(&ca, k, served.clone(), slots.clone()),
        );
    }
    for i in 0..nodes {
        sim.host(node_name(i), node_host(&ca, i, edges, counters.clone()));
    }
    let out = Rc::new(RefCell::new(Outcome::default()));
    // Set by the client once everything is ready: the step loop crashes Edge 0 from then on.
    let load_started: Rc<RefCell<Option<Duration>>> = Rc::default();
    let restarted: Rc<RefCell<Option<Duration>>> = Rc::default();
    let crashed: Rc<std::cell::Cell<bool>> = Rc::default();
    {
        let (slots, out, of_edge) = (slots.clone(), out.clone(), of_edge.clone());
        let (load_started, restarted) = (load_started.clone(), restarted.clone());
        let crashed = crashed.clone();
        sim.client("clients", async move {
            let t0 = tokio::time::Instant::now();
            // 1. Every Node ready on both its Edges.
            loop {
                let ready = {
                    let s = slots.borrow();
                    (0..edges).all(|k| {
                        s[k].handle
                            .as_ref()
                            .is_some_and(|e| all_ready(e, of_edge[k].len()))
                    })
                };
                if ready {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            out.borrow_mut().all_ready = Some(t0.elapsed());
            for k in 1..edges {
                let e = slots.borrow()[k].handle.clone().unwrap();
                for (n, g) in e.ready_nodes() {
                    out.borrow_mut().generations_before.insert((k, n), g);
                }
            }
            // 2. Load on every Edge; the step loop crashes Edge 0 a second in.
            *load_started.borrow_mut() = Some(t0.elapsed());
            let mut tasks = Vec::new();
            for (k, served) in of_edge.iter().enumerate() {
                for c in 0..served.len() * CAPACITY as usize {
                    tasks.push(tokio::task::spawn_local(client(
                        k,
                        c,
                        slots.clone(),
                        crashed.clone(),
                        out.clone(),
                    )));
                }
            }
            for t in tasks {
                t.await.unwrap();
            }
            // 3. The crashed Edge back, with all its Nodes.
            loop {
                let at = *restarted.borrow();
                let back = slots.borrow()[0]
                    .handle
                    .as_ref()
                    .is_some_and(|e| all_ready(e, of_edge[0].len()));
                if let (Some(at), true) = (at, back) {
                    out.borrow_mut().back_after_restart = Some(turmoil::elapsed() - at);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            for k in 1..edges {
                let e = slots.borrow()[k].handle.clone().unwrap();
                for (n, g) in e.ready_nodes() {
                    out.borrow_mut().generations_after.insert((k, n), g);
                }
            }
            Ok(())
        });
    }
    let (mut crashed_at, mut back) = (None, false);
    loop {
        let done = sim
            .step()
            .unwrap_or_else(|e| panic!("the simulation failed: {e}"));
        if done {
            break;
        }
        let load = *load_started.borrow();
        if let (Some(load), None) = (load, crashed_at)
            && sim.elapsed() >= load + CRASH_AT
        {
            sim.crash(edge_name(0));
            slots.borrow_mut()[0].handle = None;
            crashed.set(true);
            crashed_at = Some(sim.elapsed());
        }
        if let Some(at) = crashed_at
            && !back
            && sim.elapsed() >= at + DOWN_FOR
        {
            sim.bounce(edge_name(0));
            *restarted.borrow_mut() = Some(sim.elapsed());
            back = true;
        }
    }
    let simulated = sim.elapsed();
    drop(sim);
    Figures {
        outcome: Rc::try_unwrap(out)
            .map(RefCell::into_inner)
            .unwrap_or_default(),
        most: counters
            .most
            .iter()
            .map(|m| m.load(Ordering::Relaxed))
            .collect(),
        wall: started.elapsed(),
        simulated,
    }
}

#[test]
fn many_edges_and_nodes_keep_capacity_and_lose_nothing_when_an_edge_dies() {
    let (edges, nodes) = (env("MESH_SCALE_EDGES", 4), env("MESH_SCALE_NODES", 24));
    let f = simulate(edges, nodes);
    let o = &f.outcome;
    let sessions = nodes * 2;
    eprintln!(
        "mesh scale sim: {edges} Edges, {nodes} Nodes ({sessions} sessions, capacity {CAPACITY} \
         per Node); all ready after {:?} (simulated); {} tunnels completed on the surviving \
         Edges, {} on the crashed Edge before its crash, {} lost with it; {} Node refusals for \
         capacity retried; most at once per Node: {}; the crashed Edge had all its Nodes back \
         {:?} after its restart; {:?} simulated in {:?} of wall time",
        o.all_ready,
        o.completed,
        o.completed_crashed_edge,
        o.lost_with_crashed_edge,
        o.refused_for_capacity,
        f.most.iter().max().unwrap(),
        o.back_after_restart,
        f.simulated,
        f.wall,
    );
    assert!(
        o.failures.is_empty(),
        "failures on surviving Edges: {:?}",
        o.failures
    );
    let per_edge_clients = |k: usize| {
        (0..nodes)
            .filter(|&i| edges_of(i, edges).contains(&k))
            .count()
            * CAPACITY as usize
    };
    let expected: usize = (1..edges).map(|k| per_edge_clients(k) * PER_CLIENT).sum();
    assert_eq!(
        o.completed, expected,
        "every tunnel of a surviving Edge completed"
    );
    for (i, most) in f.most.iter().enumerate() {
        assert!(
            *most <= CAPACITY,
            "node-{i} ran {most} tunnels at once at capacity {CAPACITY}"
        );
    }
    assert!(
        f.most.contains(&CAPACITY),
        "the load kept no Node at its capacity: {:?}",
        f.most
    );
    assert!(
        o.refused_for_capacity > 0,
        "two Edges never contended for one Node"
    );
    assert!(o.lost_with_crashed_edge > 0, "the crash cut off nothing");
    assert_eq!(
        o.generations_before, o.generations_after,
        "a Node reconnected to a surviving Edge"
    );
    assert_eq!(
        o.generations_before.len(),
        (1..edges)
            .map(|k| per_edge_clients(k) / CAPACITY as usize)
            .sum::<usize>()
    );
    let back = o
        .back_after_restart
        .expect("the crashed Edge got its Nodes back");
    assert!(
        back <= Duration::from_secs(5),
        "the crashed Edge's Nodes took {back:?} of simulated time to come back"
    );
}
