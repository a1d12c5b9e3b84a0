//! TLS towards PostgreSQL: `sslmode` and `sslrootcert` in `database.url` (and in every
//! `database.shards` entry), with rustls and the broker's trust code. The URL is read
//! by [`crate::config::pg_tls`]; what each mode checks is [`connector`]'s.

use std::sync::Arc;

use rustls::DigitallySignedStruct;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

pub use crate::config::pg_tls::{PgTls, Roots, SslMode, split};
use crate::tls::{TlsError, TlsFiles};

/// The connector every connection to a database with these TLS settings uses.
/// Trust as libpq: `sslrootcert=<file>` trusts only that file, whatever the mode;
/// `verify-full` without it (or with `sslrootcert=system`) the system's roots;
/// `prefer` and `require` without it check nothing.
pub fn connector(tls: &PgTls) -> Result<tokio_postgres_rustls::MakeRustlsConnect, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let bare = || {
        rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Setup(e.to_string()))
            .map(|b| {
                b.with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth()
            })
    };
    // Plain TCP: the connector is never used, so nothing is read for it.
    let mut config = bare()?;
    if tls.mode == SslMode::Disable {
        return Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config));
    }
    let roots = match &tls.roots {
        Roots::File(path) => Some(TlsFiles::load(Some(path), None, None)?.ca_roots()?),
        Roots::System => Some(TlsFiles::default().roots()?),
        Roots::Unset if tls.mode == SslMode::VerifyFull => Some(TlsFiles::default().roots()?),
        Roots::Unset => None,
    };
    let verifier: Arc<dyn ServerCertVerifier> = match roots {
        None => Arc::new(Unchecked {
            provider: provider.clone(),
        }),
        Some(roots) => {
            let chain =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|e| TlsError::Setup(e.to_string()))?;
            if tls.mode == SslMode::VerifyFull {
                chain
            } else {
                Arc::new(ChainOnly { inner: chain })
            }
        }
    };
    config.dangerous().set_certificate_verifier(verifier);
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// `verify-ca`: the chain to a trusted root is checked, not the name in it.
#[derive(Debug)]
struct ChainOnly {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// `require` and `prefer` without `sslrootcert`: encrypted, the certificate taken as
/// it is (libpq's behaviour); the handshake's signatures are still checked.
#[derive(Debug)]
struct Unchecked {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
