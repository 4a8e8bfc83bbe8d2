//! A validating admission webhook served by the harness over HTTPS, for clusters without
//! ValidatingAdmissionPolicy (Kubernetes < 1.26, such as a v1.24 control plane): it
//! refuses `macbuilds/status` writes whose new object has a terminal phase, as the source's
//! policy `mac-ci-deny-terminal-status` did. Its own CA (made with `openssl`) goes into the
//! `ValidatingWebhookConfiguration`'s `caBundle`; the serving certificate names 127.0.0.1.

use serde_json::{Value, json};
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;

/// The phases a MacBuild never leaves; writing one is what the webhook refuses.
pub const TERMINAL_PHASES: &[&str] = &["Succeeded", "Failed", "Cancelled"];

/// The message of a refusal (scenarios and logs can look for it).
pub const REFUSAL: &str = "terminal MacBuild status refused by the e2e admission webhook mac-ci-deny-terminal-status";

/// The `AdmissionReview` answering `review` (an `admission.k8s.io/v1` request): refused (403)
/// when the new object's `status.phase` is terminal, allowed otherwise.
pub fn review_response(review: &Value) -> Value {
    let request = &review["request"];
    let phase = request["object"]["status"]["phase"].as_str();
    let refuse = phase.is_some_and(|p| TERMINAL_PHASES.contains(&p));
    let mut response = json!({"uid": request["uid"], "allowed": !refuse});
    if refuse {
        response["status"] = json!({
            "code": 403,
            "reason": "Forbidden",
            "message": format!("{REFUSAL} (status.phase {})", phase.unwrap_or_default()),
        });
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
}

/// The webhook server: a thread with its own runtime (scenarios may block theirs), stopped on drop.
pub struct Webhook {
    url: String,
    ca_pem: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Webhook {
    /// Makes a CA and a serving certificate for 127.0.0.1 in `dir` and serves on a free port.
    pub fn start(dir: &Path) -> Webhook {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        make_certificates(dir);
        let ca_pem = std::fs::read_to_string(dir.join("ca.crt")).expect("webhook CA written");
        let tls = server_config(dir);
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free port for the admission webhook");
        listener.set_nonblocking(true).expect("nonblocking listener");
        let url = format!("https://{}/validate", listener.local_addr().expect("bound address"));
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let thread = std::thread::spawn(move || serve(listener, tls, stopped));
        eprintln!("[e2e] admission webhook serving on {url}");
        Webhook {
            url,
            ca_pem,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The CA that signed the serving certificate, PEM (base64 it for `caBundle`).
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn make_certificates(dir: &Path) {
    let cnf = "[req]\ndistinguished_name = dn\n[dn]\n[ext]\nsubjectAltName = IP:127.0.0.1,DNS:localhost\n\
               basicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature,keyEncipherment\n\
               extendedKeyUsage = serverAuth\n";
    std::fs::write(dir.join("openssl.cnf"), cnf).expect("openssl config written");
    let steps = [
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj /CN=tartan-e2e-webhook-ca",
        "req -newkey rsa:2048 -nodes -keyout tls.key -out tls.csr -subj /CN=127.0.0.1",
        "x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out tls.crt -days 2 \
         -extfile openssl.cnf -extensions ext",
    ];
    tartan_testkit::real::openssl(dir, &steps)
        .unwrap_or_else(|e| panic!("the admission webhook's certificates: {e:#}"));
}

fn server_config(dir: &Path) -> Arc<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("tls.crt"))
        .and_then(|i| i.collect())
        .expect("webhook serving certificate readable");
    let key = PrivateKeyDer::from_pem_file(dir.join("tls.key")).expect("webhook serving key readable");
    // ring explicitly: the process may hold more than one rustls provider.
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("webhook serving certificate usable");
    Arc::new(config)
}

fn serve(listener: TcpListener, tls: Arc<rustls::ServerConfig>, mut stopped: tokio::sync::oneshot::Receiver<()>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("webhook runtime");
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        loop {
            let (tcp, _) = tokio::select! {
                _ = &mut stopped => return,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        eprintln!("[e2e] admission webhook: accept failed: {e}; accepting again");
                        continue;
                    }
                },
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let tls = match acceptor.accept(tcp).await {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("[e2e] admission webhook: TLS handshake failed: {e}; connection dropped");
                        return;
                    }
                };
                let svc = hyper::service::service_fn(handle);
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await
                {
                    eprintln!("[e2e] admission webhook: connection ended with an error: {e}");
                }
            });
        }
    });
}

async fn handle(
    req: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<axum::body::Body>, std::convert::Infallible> {
    let reply = |code: u16, body: Vec<u8>| {
        hyper::Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body))
            .expect("response builds")
    };
    let body = match axum::body::to_bytes(axum::body::Body::new(req.into_body()), 4 << 20).await {
        Ok(b) => b,
        Err(e) => return Ok(reply(400, format!("cannot read the AdmissionReview: {e}").into_bytes())),
    };
    let review: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return Ok(reply(400, format!("not an AdmissionReview: {e}").into_bytes())),
    };
    let response = review_response(&review);
    if response["response"]["allowed"] == false {
        let r = &review["request"];
        eprintln!(
            "[e2e] admission webhook refused {} {}/{} of {}",
            r["operation"].as_str().unwrap_or("?"),
            r["namespace"].as_str().unwrap_or("?"),
            r["name"].as_str().unwrap_or("?"),
            r["userInfo"]["username"].as_str().unwrap_or("?"),
        );
    }
    Ok(reply(200, serde_json::to_vec(&response).expect("JSON serialises")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn review(phase: Option<&str>) -> Value {
        let mut object = json!({"metadata": {"name": "build-1"}, "status": {}});
        if let Some(p) = phase {
            object["status"]["phase"] = json!(p);
        }
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
               "request": {"uid": "u-1", "operation": "UPDATE", "subResource": "status", "object": object}})
    }

    #[test]
    fn terminal_phases_are_refused_with_403() {
        for phase in TERMINAL_PHASES {
            let r = review_response(&review(Some(phase)));
            assert_eq!(r["kind"], "AdmissionReview");
            assert_eq!(r["response"]["uid"], "u-1", "the uid is echoed");
            assert_eq!(r["response"]["allowed"], false, "{phase}");
            assert_eq!(r["response"]["status"]["code"], 403);
            assert!(r["response"]["status"]["message"].as_str().unwrap().contains(phase));
        }
    }

    #[test]
    fn other_phases_and_no_phase_are_allowed() {
        for phase in [Some("Running"), Some("Pending"), Some("succeeded"), None] {
            let r = review_response(&review(phase));
            assert_eq!(r["response"]["allowed"], true, "{phase:?}");
            assert_eq!(r["response"]["uid"], "u-1");
            assert!(r["response"].get("status").is_none());
        }
    }

    /// The whole path: certificates from openssl, TLS with that CA, an AdmissionReview POSTed.
    #[test]
    fn serves_reviews_over_tls_with_its_own_ca() {
        let dir = tempfile::tempdir().unwrap();
        let hook = Webhook::start(dir.path());
        let out = Command::new("curl")
            .args(["-sS", "--fail", "--cacert"])
            .arg(dir.path().join("ca.crt"))
            .args(["-H", "content-type: application/json", "--data-binary"])
            .arg(review(Some("Failed")).to_string())
            .arg(hook.url())
            .output()
            .expect("curl runs");
        assert!(out.status.success(), "curl: {}", String::from_utf8_lossy(&out.stderr));
        let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(answer["response"]["allowed"], false, "{answer}");
        assert!(hook.ca_pem().contains("BEGIN CERTIFICATE"));
    }
}
