//! TLS towards PostgreSQL: `sslmode` and `sslrootcert` in `database.url` (and in every
//! `database.shards` entry), with rustls and the broker's trust code. The URL is read
//! by [`crate::config::pg_tls`].
//!
//! tokio-postgres reads `sslmode` only as `disable`, `prefer` or `require`, and refuses
//! `sslrootcert`: lapse takes both out of the URL, tells the driver `disable` or
//! `require` (or `prefer`), and verifies the server's certificate itself as libpq
//! would:
//! - no `sslmode`, or `disable`: plain TCP (what lapse always did; libpq's default,
//!   `prefer`, is available by naming it);
//! - `prefer`, `require`: encrypted; the certificate is not checked (as libpq), unless
//!   `sslrootcert` is given, which makes `require` behave like `verify-ca`;
//! - `verify-ca`: the certificate must chain to a trusted root;
//! - `verify-full`: that, and it must name the host connected to.
//!
//! Trusted roots are the system's plus the `sslrootcert` file (PEM), as for the broker.

use std::sync::Arc;

use rustls::DigitallySignedStruct;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

use crate::amqp::tls::{TlsError, TlsFiles};
pub use crate::config::pg_tls::{PgTls, SslMode, split};

/// The connector every connection to a database with these TLS settings uses.
pub fn connector(tls: &PgTls) -> Result<tokio_postgres_rustls::MakeRustlsConnect, TlsError> {
    {
        let this = tls;
        let files = TlsFiles::load(this.root_cert.as_deref(), None, None)?;
        let mut config = files.client_config()?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = || {
            WebPkiServerVerifier::builder_with_provider(Arc::new(files.roots()?), provider.clone())
                .build()
                .map_err(|e| TlsError::Setup(e.to_string()))
        };
        let verify_ca = this.mode == SslMode::VerifyCa
            || (matches!(this.mode, SslMode::Require | SslMode::Prefer)
                && this.root_cert.is_some());
        if verify_ca {
            let verifier = ChainOnly { inner: chain()? };
            config
                .dangerous()
                .set_certificate_verifier(Arc::new(verifier));
        } else if matches!(this.mode, SslMode::Require | SslMode::Prefer) {
            let verifier = Unchecked { provider };
            config
                .dangerous()
                .set_certificate_verifier(Arc::new(verifier));
        }
        Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
    }
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
