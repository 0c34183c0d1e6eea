//! Certificates for TLS tests, made with openssl.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A CA of its own and a server certificate it signed for localhost and
/// 127.0.0.1, made with openssl: (CA certificate, certificate, key).
pub fn tls_certificate(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    tls_certificate_for(dir, name, "DNS:localhost,IP:127.0.0.1")
}

/// As [`tls_certificate`], for the names in `san` (openssl's subjectAltName).
pub fn tls_certificate_for(dir: &Path, name: &str, san: &str) -> (PathBuf, PathBuf, PathBuf) {
    let file = |ext: &str| dir.join(format!("{name}.{ext}"));
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let (ca, ca_key) = (format!("{name}-ca.crt"), format!("{name}-ca.key"));
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=pgcache test CA",
        "-keyout",
        &ca_key,
        "-out",
        &ca,
    ]);
    let (crt, key, csr, ext) = (
        format!("{name}.crt"),
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.ext"),
    );
    std::fs::write(
        dir.join(&ext),
        format!("subjectAltName={san}\nbasicConstraints=CA:FALSE\n"),
    )
    .unwrap();
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        &key,
        "-out",
        &csr,
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        &ca,
        "-CAkey",
        &ca_key,
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &ext,
        "-out",
        &crt,
    ]);
    (dir.join(ca), file("crt"), file("key"))
}
