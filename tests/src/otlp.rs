//! An in-process OpenTelemetry collector for the tracing tests: it receives OTLP over HTTP
//! (`POST /v1/traces`, protobuf) and over gRPC (`TraceService/Export`) on two loopback ports,
//! decodes with the `opentelemetry-proto` messages, and keeps every span it got, flattened.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;

/// One span as received.
#[derive(Clone, Debug, PartialEq)]
pub struct ReceivedSpan {
    /// `service.name` of its resource.
    pub service: String,
    /// Lowercase hex.
    pub trace_id: String,
    /// Lowercase hex.
    pub span_id: String,
    /// Lowercase hex; empty for a root.
    pub parent_span_id: String,
    /// Its name.
    pub name: String,
    /// OTLP span kind (1 internal, 2 server, 3 client).
    pub kind: i32,
    /// Attributes, values written as text.
    pub attributes: BTreeMap<String, String>,
    /// Event names, in order.
    pub events: Vec<String>,
    /// OTLP status code (2 = error).
    pub status: i32,
    /// Start and end, Unix ns.
    pub start_ns: u64,
    /// End, Unix ns.
    pub end_ns: u64,
    /// Which transport brought it (`http` or `grpc`).
    pub transport: &'static str,
}

impl ReceivedSpan {
    /// An attribute's value.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn flatten(req: ExportTraceServiceRequest, transport: &'static str) -> Vec<ReceivedSpan> {
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let service = rs
            .resource
            .as_ref()
            .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
            .map(|a| text(a.value.as_ref()))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(ReceivedSpan {
                    service: service.clone(),
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    name: s.name,
                    kind: s.kind,
                    attributes: s
                        .attributes
                        .iter()
                        .map(|a| (a.key.clone(), text(a.value.as_ref())))
                        .collect(),
                    events: s.events.into_iter().map(|e| e.name).collect(),
                    status: s.status.map_or(0, |st| st.code),
                    start_ns: s.start_time_unix_nano,
                    end_ns: s.end_time_unix_nano,
                    transport,
                });
            }
        }
    }
    out
}

type Store = Arc<Mutex<Vec<ReceivedSpan>>>;

struct Grpc(Store);

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = flatten(request.into_inner(), "grpc");
        self.0.lock().expect("store").extend(spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// The collector; stops when dropped.
#[derive(Debug)]
pub struct Collector {
    /// Base URL of the HTTP/protobuf receiver (`http://127.0.0.1:port`).
    pub http: String,
    /// URL of the gRPC receiver.
    pub grpc: String,
    spans: Store,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Collector {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Collector {
    /// Starts both receivers on free loopback ports.
    pub async fn start() -> Self {
        let spans: Store = Arc::default();
        let http_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let http_addr: SocketAddr = http_listener.local_addr().expect("addr");
        let store = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: Bytes| {
                let store = store.clone();
                async move {
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(req) => {
                            store.lock().expect("store").extend(flatten(req, "http"));
                            (
                                StatusCode::OK,
                                [("content-type", "application/x-protobuf")],
                                ExportTraceServiceResponse::default().encode_to_vec(),
                            )
                        }
                        Err(_) => (
                            StatusCode::BAD_REQUEST,
                            [("content-type", "text/plain")],
                            b"not an ExportTraceServiceRequest".to_vec(),
                        ),
                    }
                }
            }),
        );
        let http_task = tokio::spawn(async move {
            let _ = axum::serve(http_listener, app).await;
        });
        let grpc_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let grpc_addr = grpc_listener.local_addr().expect("addr");
        let svc = TraceServiceServer::new(Grpc(spans.clone()));
        let grpc_task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(
                    grpc_listener,
                ))
                .await;
        });
        Self {
            http: format!("http://{http_addr}"),
            grpc: format!("http://{grpc_addr}"),
            spans,
            tasks: vec![http_task, grpc_task],
        }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().expect("store").clone()
    }

    /// The spans of trace `trace_id`.
    pub fn trace(&self, trace_id: &str) -> Vec<ReceivedSpan> {
        self.spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect()
    }

    /// Waits (up to `timeout`) until `ready` holds for the spans received, and returns them.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        ready: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if ready(&spans) || tokio::time::Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
