//! The admin HTTP API's token check over a real loopback socket: the bearer scheme is
//! case-insensitive (RFC 9110 §11.1), a wrong or missing token is 401 and changes nothing.
//! And the admin's shared projection: one build per generation for every Edge session, never
//! an older one than asked for.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::sync::Arc;

use iop_cp::admin::Admin;
use iop_cp::seal::MasterKey;
use iop_cp::store::{Mutation, SqliteStore, Store};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const TOKEN: &str = "admin-secret-7c1e";

/// `POST /admin/v1/principals` with `authorization`; the status code.
async fn create(addr: std::net::SocketAddr, id: &str, authorization: Option<&str>) -> u16 {
    let body = format!(r#"{{"id":"{id}","display_name":""}}"#);
    let auth = authorization.map_or(String::new(), |a| format!("authorization: {a}\r\n"));
    let request = format!(
        "POST /admin/v1/principals HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n{auth}content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out.split(' ').nth(1).unwrap().parse().unwrap()
}

#[tokio::test]
async fn the_admin_token_is_checked_and_its_scheme_is_case_insensitive() {
    let store: Arc<dyn Store> = Arc::new(SqliteStore::in_memory().unwrap());
    let (key, _) = MasterKey::generate().unwrap();
    let admin = Admin::new(store.clone(), Arc::new(key), 1);
    let app = iop_cp::admin_http::router(admin, None, Some(TOKEN.to_owned()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    for (auth, want) in [
        (None, 401),
        (Some("Bearer wrong".to_owned()), 401),
        (Some(format!("Basic {TOKEN}")), 401),
        (Some(TOKEN.to_owned()), 401),
    ] {
        assert_eq!(
            create(addr, "refused", auth.as_deref()).await,
            want,
            "{auth:?}"
        );
    }
    assert!(store.snapshot().await.unwrap().principals.is_empty());
    for (i, scheme) in ["Bearer", "bearer", "BEARER"].iter().enumerate() {
        let id = format!("p{i}");
        let status = create(addr, &id, Some(&format!("{scheme} {TOKEN}"))).await;
        assert!((200..300).contains(&status), "{scheme}: {status}");
    }
    assert_eq!(store.snapshot().await.unwrap().principals.len(), 3);
}

/// Every Edge session asks for the new projection at once after a mutation: they get one
/// projection, built once (the same allocation), and a caller asking for a newer generation
/// than the one cached (a mutation by another process or replica) gets the newer state.
/// Checked against two breaks (made, run, reverted): building anew on every call fails the
/// shared-allocation assertion; returning the cached projection whatever the generation asked
/// for fails the newer-state one.
#[tokio::test]
async fn edge_sessions_share_one_projection_per_generation() {
    let store: Arc<dyn Store> = Arc::new(SqliteStore::in_memory().unwrap());
    let (key, _) = MasterKey::generate().unwrap();
    let admin = Admin::new(store.clone(), Arc::new(key), 1);
    let g = admin.create_principal("team-a", "A").await.unwrap();
    let calls = (0..16).map(|_| admin.projection(g));
    let got: Vec<_> = futures_util::future::join_all(calls)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(got[0].generation, g);
    assert_eq!(got[0].principals.len(), 1);
    assert!(
        got.iter().all(|p| Arc::ptr_eq(p, &got[0])),
        "16 sessions asking for generation {g} got more than one build"
    );

    // Another process's mutation, not made through this admin.
    let newer = store
        .apply(Mutation::CreatePrincipal {
            id: "team-b".into(),
            display_name: String::new(),
        })
        .await
        .unwrap();
    assert!(newer > g);
    // Asked for what this process knew: the cached state is that generation's.
    assert_eq!(admin.projection(g).await.unwrap().generation, g);
    let p = admin.projection(newer).await.unwrap();
    assert_eq!(p.generation, newer);
    assert_eq!(p.principals.len(), 2);
    assert!(Arc::ptr_eq(&p, &admin.projection(g).await.unwrap()));

    // As pushed: every session shares one encoding of that projection, the sessions that
    // push later too; a newer generation replaces it.
    let calls = (0..16).map(|_| admin.shared_projection(newer));
    let shared: Vec<_> = futures_util::future::join_all(calls)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(shared.iter().all(|s| Arc::ptr_eq(s, &shared[0])));
    assert!(Arc::ptr_eq(shared[0].projection(), &p));
    let held = Arc::downgrade(&shared[0]);
    drop(shared);
    let again = admin.shared_projection(newer).await.unwrap();
    assert!(Arc::ptr_eq(&again, &held.upgrade().unwrap()));
    drop(again);
    let newest = admin.create_principal("team-c", "C").await.unwrap();
    let next = admin.shared_projection(newest).await.unwrap();
    assert_eq!(next.generation(), newest);
    assert!(
        held.upgrade().is_none(),
        "an older generation's encodings stayed cached"
    );
}
