//! The admin HTTP API's token check over a real loopback socket: the bearer scheme is
//! case-insensitive (RFC 9110 §11.1), a wrong or missing token is 401 and changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::sync::Arc;

use iop_cp::admin::Admin;
use iop_cp::seal::MasterKey;
use iop_cp::store::{SqliteStore, Store};
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
