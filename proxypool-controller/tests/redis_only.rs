//! Redis-only store behaviour: the ownership epoch loses any old TTL, and scripts keep working
//! after the script cache is flushed (`NOSCRIPT` after a restart or failover). Its own test
//! binary: `SCRIPT FLUSH` must not race the contract suite's scripts on the shared server.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test")]

use proxypool_controller::domain::ControlStore;
use proxypool_controller::redis_store::RedisStore;

#[tokio::test]
async fn redis_epoch_is_persistent_even_if_it_had_a_ttl() {
    let url = std::env::var("PROXYPOOL_TEST_REDIS_URL").expect("PROXYPOOL_TEST_REDIS_URL");
    let store = RedisStore::connect(&url, "epoch-ttl").await.unwrap();
    let mut conn = store.connection();
    let key = store.epoch_key();
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("7")
        .arg("PX")
        .arg(100_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(store.current_ownership_epoch().await.unwrap(), 7);
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(ttl, -1, "the old TTL is removed");
    // NOSCRIPT after a restart or failover: the script cache is flushed and calls still work.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(store.current_ownership_epoch().await.unwrap(), 7);
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
}
