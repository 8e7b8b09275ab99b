//! Property test of the Edge registry's fencing: operation sequences against a small reference
//! model written from the rules in seed 000 (moved from `iop-wire` with the registry).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use iop_edge_core::registry::{ConnId, FenceCause, Registry, RegistryConfig, RegistryEvent};
use iop_wire::runtime::{
    NodeConfigPayload, NodeReadyRequest, RegisterRequest, RunEvent, RunEventKind, RuntimeFrame,
    RuntimeMessage,
};
use proptest::prelude::*;

// === registry fencing ===

#[derive(Clone, Debug)]
enum ROp {
    Accept,
    Register { conn: u8, node: u8 },
    Ready { conn: u8, node: u8 },
    Close { conn: u8 },
    AppFrame { conn: u8 },
}

const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];

fn registry_op() -> impl Strategy<Value = ROp> {
    prop_oneof![
        2 => Just(ROp::Accept),
        3 => (0u8..6, 0u8..3).prop_map(|(conn, node)| ROp::Register { conn, node }),
        3 => (0u8..6, 0u8..3).prop_map(|(conn, node)| ROp::Ready { conn, node }),
        2 => (0u8..6).prop_map(|conn| ROp::Close { conn }),
        1 => (0u8..6).prop_map(|conn| ROp::AppFrame { conn }),
    ]
}

/// Lifecycle events the model predicts, with generations as the model numbers them.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Life {
    Registered(usize, u64),
    Ready(usize, u64),
    Fenced(usize, u64),
    Frame(usize, u64),
}

#[derive(Default)]
struct Model {
    /// conn index -> Some(bound node) / None (unbound); absent = closed.
    conns: HashMap<u8, Option<usize>>,
    /// node -> (conn, generation, ready)
    owners: HashMap<usize, (u8, u64, bool)>,
    next_gen: u64,
}

impl Model {
    fn is_owner(&self, conn: u8) -> Option<(usize, u64, bool)> {
        let node = (*self.conns.get(&conn)?)?;
        let &(c, g, r) = self.owners.get(&node)?;
        (c == conn).then_some((node, g, r))
    }

    fn close(&mut self, conn: u8, out: &mut Vec<Life>) {
        if let Some((node, g, ready)) = self.is_owner(conn) {
            self.owners.remove(&node);
            if ready {
                out.push(Life::Fenced(node, g));
            }
        }
        self.conns.remove(&conn);
    }

    fn apply(&mut self, op: &ROp, out: &mut Vec<Life>) {
        match *op {
            ROp::Accept => {}
            ROp::Register { conn, node } => {
                let node = usize::from(node);
                let Some(binding) = self.conns.get(&conn) else {
                    return;
                };
                if binding.is_some() {
                    return; // rejected, nothing changes
                }
                self.next_gen += 1;
                let g = self.next_gen;
                self.conns.insert(conn, Some(node));
                if let Some((old_conn, old_g, ready)) = self.owners.insert(node, (conn, g, false)) {
                    if ready {
                        out.push(Life::Fenced(node, old_g));
                    }
                    self.conns.remove(&old_conn);
                }
                out.push(Life::Registered(node, g));
            }
            ROp::Ready { conn, node } => {
                let node = usize::from(node);
                if !self.conns.contains_key(&conn) {
                    return;
                }
                match self.is_owner(conn) {
                    Some((n, g, ready)) if n == node => {
                        if !ready {
                            self.owners.insert(node, (conn, g, true));
                            out.push(Life::Ready(node, g));
                        }
                    }
                    _ => self.close(conn, out),
                }
            }
            ROp::Close { conn } => self.close(conn, out),
            ROp::AppFrame { conn } => match self.is_owner(conn) {
                Some((n, g, true)) => out.push(Life::Frame(n, g)),
                _ => self.close(conn, out),
            },
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn registry_fencing_matches_the_model(ops in proptest::collection::vec(registry_op(), 0..60)) {
        let now = Instant::now();
        let mut reg = Registry::new(RegistryConfig {
            default_node_config: Some(NodeConfigPayload::default()),
            // The model covers ownership and fencing; the handshake timeout has its own test.
            handshake_timeout: Duration::MAX,
            ..Default::default()
        });
        let mut model = Model::default();
        let mut conns: Vec<ConnId> = Vec::new();
        // Registry generation -> model generation, learned from Registered events in order.
        let mut gen_map = HashMap::new();
        let node_index = |id: &str| NODES.iter().position(|n| *n == id).unwrap();

        for op in &ops {
            let mut expected = Vec::new();
            if let ROp::Accept = op {
                if conns.len() < 6 {
                    let idx = u8::try_from(conns.len()).unwrap();
                    conns.push(reg.accept(now, None));
                    model.conns.insert(idx, None);
                }
                continue;
            }
            let conn_of = |c: u8| conns.get(usize::from(c)).copied();
            let applies = match *op {
                ROp::Register { conn, .. } | ROp::Ready { conn, .. } | ROp::Close { conn } | ROp::AppFrame { conn } => conn_of(conn).is_some(),
                ROp::Accept => false,
            };
            if !applies {
                continue;
            }
            model.apply(op, &mut expected);
            match *op {
                ROp::Register { conn, node } => reg.handle_frame(now, conn_of(conn).unwrap(), RuntimeFrame::new(
                    RuntimeMessage::RegisterRequest(RegisterRequest { node_id: NODES[usize::from(node)].into(), ..Default::default() }))),
                ROp::Ready { conn, node } => reg.handle_frame(now, conn_of(conn).unwrap(), RuntimeFrame::new(
                    RuntimeMessage::NodeReadyRequest(NodeReadyRequest { node_id: NODES[usize::from(node)].into() }))),
                ROp::Close { conn } => reg.handle_close(conn_of(conn).unwrap()),
                ROp::AppFrame { conn } => reg.handle_frame(now, conn_of(conn).unwrap(), RuntimeFrame::on_stream(1,
                    RuntimeMessage::RunEvent(RunEvent::new(RunEventKind::Delta)))),
                ROp::Accept => unreachable!(),
            }
            while reg.poll_transmit().is_some() {}
            let mut got = Vec::new();
            while let Some(e) = reg.poll_event() {
                match e {
                    RegistryEvent::Registered { node_id, generation, .. } => {
                        let model_gen = u64::try_from(gen_map.len()).unwrap() + 1;
                        gen_map.insert(generation, model_gen);
                        got.push(Life::Registered(node_index(&node_id), model_gen));
                    }
                    RegistryEvent::NodeReady { node_id, generation, .. } => got.push(Life::Ready(node_index(&node_id), gen_map[&generation])),
                    RegistryEvent::NodeFenced { node_id, generation, cause } => {
                        prop_assert!(cause != FenceCause::HeartbeatTimeout);
                        got.push(Life::Fenced(node_index(&node_id), gen_map[&generation]));
                    }
                    RegistryEvent::Frame { node_id, generation, .. } => got.push(Life::Frame(node_index(&node_id), gen_map[&generation])),
                    RegistryEvent::CloseConnection { .. } => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
            // A supersede reports the old generation's fence before the new registration.
            prop_assert_eq!(&got, &expected, "after {:?}", op);
            // Registry state agrees with the model.
            for (n, id) in NODES.iter().enumerate() {
                let want = model.owners.get(&n).map(|&(c, g, r)| (conns[usize::from(c)], g, r));
                let have = reg.ready_generation(id).map(|(c, g)| (c, gen_map[&g], true))
                    .or_else(|| reg.pending_generation(id).map(|(c, g)| (c, gen_map[&g], false)));
                prop_assert_eq!(have, want);
            }
        }
    }
}
