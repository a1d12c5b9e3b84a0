//! TLS material and verification for every connection lapse makes: the broker
//! (`amqps://`, and `https://` for the management API) and PostgreSQL (`db::tls`
//! builds its connector from the same files and checks).
//!
//! Invariants: the server's certificate is always verified — against the system's
//! root certificates plus, when configured, a CA file; there is no switch that turns
//! verification off. A client certificate is optional. The TLS stack is rustls with
//! the `ring` provider (no system toolchain or OpenSSL needed). Key material is never
//! printed (`Debug` shows only whether it is present).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} holds no PEM certificate", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{} holds no PEM private key", path.display())]
    NoKey { path: PathBuf },
    #[error("a client certificate needs both cert_file and key_file")]
    HalfIdentity,
    #[error("the client certificate and key do not form a usable identity: {0}")]
    Identity(String),
    #[error("cannot build the TLS client configuration: {0}")]
    Setup(String),
}

/// The TLS material lapse presents and trusts, read from the configured files.
#[derive(Clone, Default)]
pub struct TlsFiles {
    /// Extra trusted CA certificates (PEM), on top of the system roots.
    ca_pem: Option<String>,
    /// Client certificate chain and private key (both PEM).
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsFiles")
            .field("extra_ca", &self.ca_pem.is_some())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

impl TlsFiles {
    /// Reads and checks the files: the CA file and the certificate file must hold at
    /// least one PEM certificate, the key file a PEM private key; a certificate needs a
    /// key and the other way round.
    pub fn load(
        ca_file: Option<&Path>,
        cert_file: Option<&Path>,
        key_file: Option<&Path>,
    ) -> Result<Self, TlsError> {
        let ca_pem = match ca_file {
            Some(path) => {
                let pem = read(path)?;
                certificates(path, &pem)?;
                Some(String::from_utf8_lossy(&pem).into_owned())
            }
            None => None,
        };
        let identity = match (cert_file, key_file) {
            (None, None) => None,
            (Some(cert), Some(key)) => {
                let cert_pem = read(cert)?;
                certificates(cert, &cert_pem)?;
                let key_pem = read(key)?;
                private_key(key, &key_pem)?;
                Some((cert_pem, key_pem))
            }
            _ => return Err(TlsError::HalfIdentity),
        };
        let files = Self { ca_pem, identity };
        // Building the client configuration once proves that key and certificate match.
        files.client_config()?;
        Ok(files)
    }

    pub fn is_empty(&self) -> bool {
        self.ca_pem.is_none() && self.identity.is_none()
    }

    /// The settings lapin uses for an `amqps://` connection (it verifies against the
    /// system roots plus `cert_chain`).
    pub fn amqp(&self) -> OwnedTLSConfig {
        OwnedTLSConfig {
            identity: self
                .identity
                .as_ref()
                .map(|(pem, key)| OwnedIdentity::PKCS8 {
                    pem: pem.clone(),
                    key: key.clone(),
                }),
            cert_chain: self.ca_pem.clone(),
        }
    }

    /// The certificates trusted: the system's roots plus the CA file's.
    pub fn roots(&self) -> Result<rustls::RootCertStore, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        // Unreadable entries of the system store are skipped, as every TLS client does.
        let native = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(native.certs);
        self.add_ca(&mut roots)?;
        Ok(roots)
    }

    /// Only the CA file's certificates (none without one).
    pub fn ca_roots(&self) -> Result<rustls::RootCertStore, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        self.add_ca(&mut roots)?;
        Ok(roots)
    }

    fn add_ca(&self, roots: &mut rustls::RootCertStore) -> Result<(), TlsError> {
        if let Some(pem) = &self.ca_pem {
            let extra = CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| TlsError::Setup(e.to_string()))?;
            roots.add_parsable_certificates(extra);
        }
        Ok(())
    }

    /// A rustls client configuration with the same trust and identity, for HTTPS.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, TlsError> {
        let roots = self.roots()?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Setup(e.to_string()))?
            .with_root_certificates(roots);
        match &self.identity {
            None => Ok(builder.with_no_client_auth()),
            Some((cert_pem, key_pem)) => {
                let certs = CertificateDer::pem_slice_iter(cert_pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| TlsError::Identity(e.to_string()))?;
                let key = PrivateKeyDer::from_pem_slice(key_pem)
                    .map_err(|e| TlsError::Identity(e.to_string()))?;
                builder
                    .with_client_auth_cert(certs, key)
                    .map_err(|e| TlsError::Identity(e.to_string()))
            }
        }
    }

    /// An HTTP client builder with this trust and identity. reqwest is built without a
    /// crypto provider of its own (its default would pull in aws-lc), so
    /// `reqwest::Client::new()` would panic: build every HTTP client through this.
    pub fn http_client(&self) -> Result<reqwest::ClientBuilder, TlsError> {
        Ok(reqwest::Client::builder().tls_backend_preconfigured(self.client_config()?))
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn certificates(path: &Path, pem: &[u8]) -> Result<(), TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .unwrap_or_default();
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(())
}

fn private_key(path: &Path, pem: &[u8]) -> Result<(), TlsError> {
    PrivateKeyDer::from_pem_slice(pem)
        .map(|_| ())
        .map_err(|_| TlsError::NoKey {
            path: path.to_path_buf(),
        })
}

/// True when `err` (or anything in its source chain) is a rejected server certificate.
pub fn is_certificate_error(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(rustls::Error::InvalidCertificate(_)) = e.downcast_ref::<rustls::Error>() {
            return true;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && is_certificate_error(inner)
        {
            return true;
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_files_means_system_roots_only() {
        let files = TlsFiles::load(None, None, None).unwrap();
        assert!(files.is_empty());
        assert_eq!(files.amqp(), OwnedTLSConfig::default());
    }

    #[test]
    fn an_http_client_builds_without_a_process_wide_crypto_provider() {
        TlsFiles::default().http_client().unwrap().build().unwrap();
    }

    #[test]
    fn a_certificate_without_a_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("c.pem");
        std::fs::write(&cert, "x").unwrap();
        assert!(matches!(
            TlsFiles::load(None, Some(&cert), None),
            Err(TlsError::HalfIdentity)
        ));
    }

    #[test]
    fn a_file_without_a_certificate_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "not a certificate\n").unwrap();
        let err = TlsFiles::load(Some(&ca), None, None).unwrap_err();
        assert!(matches!(err, TlsError::NoCertificate { .. }), "{err}");
        let missing = dir.path().join("missing.pem");
        let err = TlsFiles::load(Some(&missing), None, None).unwrap_err();
        assert!(matches!(err, TlsError::Read { .. }), "{err}");
    }

    #[test]
    fn a_client_certificate_loads_only_with_its_own_key() {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["lapse".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let (cert_file, key_file, other_file) = (
            dir.path().join("c.pem"),
            dir.path().join("k.pem"),
            dir.path().join("o.pem"),
        );
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        let other = rcgen::KeyPair::generate().unwrap();
        std::fs::write(&other_file, other.serialize_pem()).unwrap();

        let files = TlsFiles::load(None, Some(&cert_file), Some(&key_file)).unwrap();
        assert!(files.amqp().identity.is_some());
        assert!(!format!("{files:?}").contains("PRIVATE KEY"));
        let err = TlsFiles::load(None, Some(&cert_file), Some(&other_file)).unwrap_err();
        assert!(matches!(err, TlsError::Identity(_)), "{err}");
        let err = TlsFiles::load(None, Some(&cert_file), Some(&cert_file)).unwrap_err();
        assert!(matches!(err, TlsError::NoKey { .. }), "{err}");
    }

    #[test]
    fn a_rejected_certificate_is_recognised_through_io_errors() {
        let rejected = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, rejected);
        assert!(is_certificate_error(&io));
        let other = std::io::Error::other("connection refused");
        assert!(!is_certificate_error(&other));
    }
}
