//! Rate-limited logging: `bounded_http::RateLimited`, shared with every listener.

pub(crate) use bounded_http::RateLimited;
