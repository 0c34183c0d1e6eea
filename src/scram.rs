//! SCRAM-SHA-256 (RFC 5802, RFC 7677) on both sides: pgcache as the server
//! its clients log in to (admin console, `auth.mode = terminate`), with
//! `tls-server-end-point` channel binding, and as the client of PostgreSQL
//! when it logs in on a client's behalf.
//!
//! A server that checked a client's proof learns the client's `ClientKey`
//! (proof XOR signature). With the same verifier as PostgreSQL's, that key
//! logs in to PostgreSQL without the password, as PgBouncer does.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// PostgreSQL's default iteration count.
pub const ITERATIONS: u32 = 4096;

pub const MECHANISM: &str = "SCRAM-SHA-256";
pub const MECHANISM_PLUS: &str = "SCRAM-SHA-256-PLUS";

fn hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

fn xor(a: &[u8; 32], b: &[u8; 32]) -> [u8; 32] {
    std::array::from_fn(|i| a[i] ^ b[i])
}

/// Every byte compared, whatever the first difference.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The password as SCRAM hashes it: SASLprep'd, or as is when it cannot be
/// (PostgreSQL does the same).
fn prepared(password: &str) -> std::borrow::Cow<'_, str> {
    stringprep::saslprep(password).unwrap_or(std::borrow::Cow::Borrowed(password))
}

fn salted_password(password: &str, salt: &[u8], iterations: u32) -> [u8; 32] {
    let mut salted = [0u8; 32];
    pbkdf2::pbkdf2_hmac::<Sha256>(prepared(password).as_bytes(), salt, iterations, &mut salted);
    salted
}

/// What a server stores of a password: PostgreSQL's
/// `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`.
#[derive(Clone, PartialEq, Eq)]
pub struct Verifier {
    pub iterations: u32,
    pub salt: Vec<u8>,
    pub stored_key: [u8; 32],
    pub server_key: [u8; 32],
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Verifier(..)")
    }
}

impl Verifier {
    pub fn from_password(password: &str, salt: &[u8], iterations: u32) -> Self {
        let salted = salted_password(password, salt, iterations);
        let client_key = hmac(&salted, b"Client Key");
        Self {
            iterations,
            salt: salt.to_vec(),
            stored_key: Sha256::digest(client_key).into(),
            server_key: hmac(&salted, b"Server Key"),
        }
    }

    /// A verifier with a fresh random salt.
    pub fn random(password: &str) -> Self {
        let mut salt = [0u8; 16];
        rand::fill(&mut salt);
        Self::from_password(password, &salt, ITERATIONS)
    }

    /// Parses PostgreSQL's text form (as in `pg_authid.rolpassword`).
    pub fn parse(text: &str) -> Option<Self> {
        let rest = text.strip_prefix("SCRAM-SHA-256$")?;
        let (params, keys) = rest.split_once('$')?;
        let (iterations, salt) = params.split_once(':')?;
        let (stored, server) = keys.split_once(':')?;
        let key = |s: &str| -> Option<[u8; 32]> { B64.decode(s).ok()?.try_into().ok() };
        Some(Self {
            iterations: iterations.parse().ok().filter(|i| *i > 0)?,
            salt: B64.decode(salt).ok()?,
            stored_key: key(stored)?,
            server_key: key(server)?,
        })
    }

    /// PostgreSQL's text form, as `pg_authid.rolpassword` holds it.
    pub fn to_text(&self) -> String {
        format!(
            "SCRAM-SHA-256${}:{}${}:{}",
            self.iterations,
            B64.encode(&self.salt),
            B64.encode(self.stored_key),
            B64.encode(self.server_key)
        )
    }

    /// A verifier no password matches, for users that do not exist: the
    /// exchange runs to its end so as not to tell who exists. The salt is
    /// derived from the name so that it is the same on every attempt.
    pub fn impossible(user: &str, secret: &[u8; 32]) -> Self {
        let salt = hmac(secret, user.as_bytes());
        let mut stored_key = [0u8; 32];
        rand::fill(&mut stored_key);
        Self {
            iterations: ITERATIONS,
            salt: salt[..16].to_vec(),
            stored_key,
            server_key: [0u8; 32],
        }
    }
}

/// Why a SCRAM exchange, or a configured secret, was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScramError {
    /// A message lacks a part, or a part does not decode.
    #[error("malformed {0}")]
    Malformed(&'static str),
    #[error("unsupported mechanism {0:?} or gs2 flag")]
    Mechanism(String),
    #[error("unsupported channel-binding type")]
    BindingType,
    #[error("no channel-binding data for this certificate")]
    NoBindingData,
    #[error(
        "the client supports channel binding but thinks the server does not: a downgrade, refused"
    )]
    Downgrade,
    #[error("channel binding data does not match")]
    BindingMismatch,
    #[error("nonce does not match")]
    NonceMismatch,
    #[error("password authentication failed")]
    WrongProof,
    #[error("the server's nonce does not extend ours")]
    ServerNonce,
    #[error(
        "PostgreSQL's SCRAM verifier for this user differs from the one pgcache authenticated \
         the client with (salt or iteration count)"
    )]
    VerifierDiffers,
    #[error("the server refused: {0}")]
    ServerRefused(String),
    #[error("the server's signature is wrong")]
    ServerSignature,
    #[error(
        "an MD5 hash cannot check a SCRAM login: give the password or its SCRAM-SHA-256 verifier"
    )]
    Md5Hash,
}

/// The first fields of a client-first-message.
fn split_client_first(message: &str) -> Result<(&str, &str, &str), ScramError> {
    let mut parts = message.splitn(3, ',');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(cbind), Some(authzid), Some(bare)) => Ok((cbind, authzid, bare)),
        _ => Err(ScramError::Malformed("SCRAM client-first-message")),
    }
}

/// The gs2 channel-binding flag a client sent: `n` (no support), `y`
/// (supported, but the client thinks the server does not), `p=...` (used).
pub fn client_binding_flag(client_first: &[u8]) -> Option<u8> {
    client_first.first().copied()
}

/// The server's side of one exchange, after its first message.
pub struct ServerExchange {
    verifier: Verifier,
    gs2_header: String,
    /// The channel-binding data the client must echo (`p=` only).
    binding: Vec<u8>,
    nonce: String,
    client_first_bare: String,
    server_first: String,
}

/// Channel binding as the server sees it.
#[derive(Clone, Copy)]
pub struct ServerBinding<'a> {
    /// SCRAM-SHA-256-PLUS was offered (the client leg is TLS).
    pub offered: bool,
    /// `tls-server-end-point` data: the hash of the server's certificate.
    pub data: Option<&'a [u8]>,
}

/// Reads the client's first message under `mechanism`; returns the exchange
/// and the server's first message.
pub fn server_first(
    verifier: Verifier,
    mechanism: &str,
    client_first: &str,
    binding: ServerBinding<'_>,
) -> Result<(ServerExchange, String), ScramError> {
    let (cbind, authzid, bare) = split_client_first(client_first)?;
    let binding_data = match (mechanism, cbind) {
        (MECHANISM, "n") => Vec::new(),
        (MECHANISM, "y") if binding.offered => {
            return Err(ScramError::Downgrade);
        }
        (MECHANISM, "y") => Vec::new(),
        (MECHANISM_PLUS, "p=tls-server-end-point") if binding.offered => {
            binding.data.ok_or(ScramError::NoBindingData)?.to_vec()
        }
        (MECHANISM_PLUS, _) => return Err(ScramError::BindingType),
        _ => return Err(ScramError::Mechanism(mechanism.to_owned())),
    };
    let client_nonce =
        attribute(bare, 'r').ok_or(ScramError::Malformed("client-first-message: no nonce"))?;
    let mut nonce_bytes = [0u8; 18];
    rand::fill(&mut nonce_bytes);
    let nonce = format!("{client_nonce}{}", B64.encode(nonce_bytes));
    let server_first = format!(
        "r={nonce},s={},i={}",
        B64.encode(&verifier.salt),
        verifier.iterations
    );
    Ok((
        ServerExchange {
            verifier,
            gs2_header: format!("{cbind},{authzid},"),
            binding: binding_data,
            nonce,
            client_first_bare: bare.to_owned(),
            server_first: server_first.clone(),
        },
        server_first,
    ))
}

/// A client that proved it knows the password.
pub struct Proven {
    /// The server-final-message to send.
    pub server_final: String,
    /// The client's key, recovered from its proof.
    pub client_key: [u8; 32],
}

impl ServerExchange {
    /// Checks the client's proof. `Err` is any failure: a wrong password
    /// and a malformed message get the same answer.
    pub fn finish(self, client_final: &str) -> Result<Proven, ScramError> {
        let (without_proof, proof) = client_final
            .rsplit_once(",p=")
            .ok_or(ScramError::Malformed("client-final-message: no proof"))?;
        let binding = attribute(without_proof, 'c')
            .ok_or(ScramError::Malformed("client-final-message: no c="))?;
        let mut expected = self.gs2_header.clone().into_bytes();
        expected.extend_from_slice(&self.binding);
        if !same(&B64.decode(binding).unwrap_or_default(), &expected) {
            return Err(ScramError::BindingMismatch);
        }
        if attribute(without_proof, 'r') != Some(self.nonce.as_str()) {
            return Err(ScramError::NonceMismatch);
        }
        let proof: [u8; 32] = B64
            .decode(proof)
            .ok()
            .and_then(|p| p.try_into().ok())
            .ok_or(ScramError::Malformed("proof"))?;
        let auth_message = format!(
            "{},{},{without_proof}",
            self.client_first_bare, self.server_first
        );
        let signature = hmac(&self.verifier.stored_key, auth_message.as_bytes());
        let client_key = xor(&proof, &signature);
        let recovered: [u8; 32] = Sha256::digest(client_key).into();
        if !same(&recovered, &self.verifier.stored_key) {
            return Err(ScramError::WrongProof);
        }
        let server_signature = hmac(&self.verifier.server_key, auth_message.as_bytes());
        Ok(Proven {
            server_final: format!("v={}", B64.encode(server_signature)),
            client_key,
        })
    }
}

/// What pgcache proves itself with towards PostgreSQL.
#[derive(Clone)]
pub enum ClientSecret {
    Password(String),
    /// A `ClientKey` recovered from a client's proof, with the verifier it
    /// was checked against (for the salt, the count and the `ServerKey`).
    Key {
        client_key: [u8; 32],
        verifier: Verifier,
    },
}

/// The client's side of one exchange.
pub struct ClientExchange {
    secret: ClientSecret,
    nonce: String,
    expected_signature: Option<[u8; 32]>,
}

/// The gs2 header pgcache sends: it never uses channel binding itself
/// (`n`), which PostgreSQL accepts on TLS connections too.
const CLIENT_GS2: &str = "n,,";

impl ClientExchange {
    /// Returns the exchange and the client-first-message.
    pub fn start(secret: ClientSecret) -> (Self, String) {
        let mut nonce = [0u8; 18];
        rand::fill(&mut nonce);
        let nonce = B64.encode(nonce);
        let first = format!("{CLIENT_GS2}n=,r={nonce}");
        (
            Self {
                secret,
                nonce,
                expected_signature: None,
            },
            first,
        )
    }

    /// Answers the server-first-message with the client-final-message.
    pub fn respond(&mut self, server_first: &str) -> Result<String, ScramError> {
        let malformed = ScramError::Malformed;
        let nonce =
            attribute(server_first, 'r').ok_or(malformed("server-first-message: no nonce"))?;
        if !nonce.starts_with(&self.nonce) {
            return Err(ScramError::ServerNonce);
        }
        let salt = attribute(server_first, 's')
            .and_then(|s| B64.decode(s).ok())
            .ok_or(malformed("server-first-message: no base64 salt"))?;
        let iterations: u32 = attribute(server_first, 'i')
            .and_then(|i| i.parse().ok())
            .filter(|i| *i > 0)
            .ok_or(malformed("server-first-message: no iteration count"))?;
        let (client_key, server_key) = match &self.secret {
            ClientSecret::Password(password) => {
                let salted = salted_password(password, &salt, iterations);
                (hmac(&salted, b"Client Key"), hmac(&salted, b"Server Key"))
            }
            ClientSecret::Key {
                client_key,
                verifier,
            } => {
                if verifier.salt != salt || verifier.iterations != iterations {
                    return Err(ScramError::VerifierDiffers);
                }
                (*client_key, verifier.server_key)
            }
        };
        let without_proof = format!("c={},r={nonce}", B64.encode(CLIENT_GS2));
        let auth_message = format!("n=,r={},{server_first},{without_proof}", self.nonce);
        let stored_key: [u8; 32] = Sha256::digest(client_key).into();
        let proof = xor(&client_key, &hmac(&stored_key, auth_message.as_bytes()));
        self.expected_signature = Some(hmac(&server_key, auth_message.as_bytes()));
        Ok(format!("{without_proof},p={}", B64.encode(proof)))
    }

    /// Checks the server's signature: it knew the verifier too.
    pub fn verify(&self, server_final: &str) -> Result<(), ScramError> {
        if let Some(error) = attribute(server_final, 'e') {
            return Err(ScramError::ServerRefused(error.to_owned()));
        }
        let signature = attribute(server_final, 'v')
            .and_then(|v| B64.decode(v).ok())
            .ok_or(ScramError::Malformed("server-final-message"))?;
        match &self.expected_signature {
            Some(expected) if same(expected, &signature) => Ok(()),
            _ => Err(ScramError::ServerSignature),
        }
    }
}

fn attribute(message: &str, name: char) -> Option<&str> {
    message
        .split(',')
        .find_map(|a| a.strip_prefix(name)?.strip_prefix('='))
}

/// What pgcache knows of one user's password.
#[derive(Clone)]
pub struct Credentials {
    pub verifier: Verifier,
    /// Known when the configuration gives the password itself.
    pub password: Option<String>,
}

pub fn credentials(value: &str) -> Result<Credentials, ScramError> {
    if value.starts_with("SCRAM-SHA-256$") {
        let verifier =
            Verifier::parse(value).ok_or(ScramError::Malformed("SCRAM-SHA-256 verifier"))?;
        return Ok(Credentials {
            verifier,
            password: None,
        });
    }
    if value.len() == 35 && value.starts_with("md5") {
        return Err(ScramError::Md5Hash);
    }
    Ok(Credentials {
        verifier: Verifier::random(value),
        password: Some(value.to_owned()),
    })
}

/// Checks `auth.users` the way `auth::Authenticator` will read it.
pub fn validate_users(users: &std::collections::BTreeMap<String, String>) -> Vec<String> {
    users
        .iter()
        .filter_map(|(user, value)| {
            credentials(value)
                .err()
                .map(|e| format!("auth.users.{user}: {e}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_BINDING: ServerBinding<'static> = ServerBinding {
        offered: false,
        data: None,
    };

    /// Runs a whole exchange between our two sides.
    fn exchange(verifier: Verifier, secret: ClientSecret) -> Result<Proven, ScramError> {
        let (mut client, first) = ClientExchange::start(secret);
        let (server, server_first) = server_first(verifier, MECHANISM, &first, NO_BINDING)?;
        let client_final = client.respond(&server_first)?;
        let proven = server.finish(&client_final)?;
        client.verify(&proven.server_final)?;
        Ok(proven)
    }

    #[test]
    fn right_password_passes_wrong_one_fails() {
        let verifier = Verifier::random("secret");
        assert!(exchange(verifier.clone(), ClientSecret::Password("secret".into())).is_ok());
        assert!(exchange(verifier, ClientSecret::Password("wrong".into())).is_err());
    }

    #[test]
    fn a_recovered_client_key_logs_in_again_with_the_same_verifier() {
        let verifier = Verifier::random("secret");
        let proven = exchange(verifier.clone(), ClientSecret::Password("secret".into())).unwrap();
        let key = ClientSecret::Key {
            client_key: proven.client_key,
            verifier: verifier.clone(),
        };
        assert!(exchange(verifier, key.clone()).is_ok());
        // Another salt (another verifier of the same password): refused
        // with a message that says why.
        let err = exchange(Verifier::random("secret"), key).err().unwrap();
        assert_eq!(err, ScramError::VerifierDiffers);
        assert!(err.to_string().contains("verifier"), "{err}");
    }

    #[test]
    fn postgresql_verifiers_parse_and_match_their_password() {
        // From PostgreSQL 15.19: SET password_encryption = 'scram-sha-256';
        // CREATE ROLE .. PASSWORD 'pencil'; SELECT rolpassword FROM pg_authid.
        let text = "SCRAM-SHA-256$4096:JQjB/aN5TbKwJCygeZ+j3A==$\
                    Tzoz6eZLuxCfpdmBpSSeSPyU+U8JUF591mGoCEZ0G5E=:\
                    l/SFcu24OneqhFxOUnYuh5CmA1Tf81b40EF9ytX2LPA=";
        let parsed = Verifier::parse(text).unwrap();
        assert_eq!(parsed.iterations, 4096);
        let ours = Verifier::from_password("pencil", &parsed.salt, 4096);
        assert_eq!(parsed, ours);
        assert_eq!(ours.to_text(), text.replace(' ', ""));
        assert!(Verifier::parse("md5abcdef").is_none());
        assert!(Verifier::parse("SCRAM-SHA-256$0:c2FsdA==$AA==:AA==").is_none());
    }

    #[test]
    fn channel_binding_is_checked_and_downgrades_refused() {
        let verifier = Verifier::random("s");
        let plus = ServerBinding {
            offered: true,
            data: Some(b"cert-hash"),
        };
        // 'y' while PLUS was offered: a downgrade.
        assert!(server_first(verifier.clone(), MECHANISM, "y,,n=,r=abc", plus).is_err());
        assert!(server_first(verifier.clone(), MECHANISM, "y,,n=,r=abc", NO_BINDING).is_ok());
        // PLUS with the right data passes the binding check (the proof is
        // then what fails), with other data it does not.
        let (server, first) = server_first(
            verifier.clone(),
            MECHANISM_PLUS,
            "p=tls-server-end-point,,n=,r=abc",
            plus,
        )
        .unwrap();
        let nonce = attribute(&first, 'r').unwrap();
        let c = B64.encode(b"p=tls-server-end-point,,other");
        let err = server
            .finish(&format!("c={c},r={nonce},p=AAAA"))
            .err()
            .unwrap();
        assert_eq!(err, ScramError::BindingMismatch);
        assert!(
            server_first(
                verifier.clone(),
                MECHANISM_PLUS,
                "p=tls-unique,,n=,r=a",
                plus
            )
            .is_err()
        );
        assert!(server_first(verifier, MECHANISM, "garbage", NO_BINDING).is_err());
    }
}
