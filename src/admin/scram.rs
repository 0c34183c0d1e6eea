//! The server side of SCRAM-SHA-256 (RFC 5802, RFC 7677), without channel
//! binding, for the admin console. The password is the one in the config;
//! a fresh salt is drawn for each login, so no verifier is stored.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

const ITERATIONS: u32 = 4096;

fn hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

/// An exchange after the server's first message.
pub struct Exchange {
    salted: [u8; 32],
    gs2_header: String,
    nonce: String,
    client_first_bare: String,
    server_first: String,
}

/// Reads the client's first message; returns the exchange and the server's
/// first message.
pub fn server_first(password: &str, client_first: &str) -> Result<(Exchange, String), String> {
    let mut parts = client_first.splitn(3, ',');
    let (Some(cbind), Some(authzid), Some(bare)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err("malformed SCRAM client-first-message".into());
    };
    match cbind {
        "n" | "y" => {}
        _ => return Err("channel binding is not supported by the pgcache admin console".into()),
    }
    let client_nonce = attribute(bare, 'r').ok_or("client-first-message without a nonce")?;
    let mut nonce_bytes = [0u8; 18];
    rand::fill(&mut nonce_bytes);
    let nonce = format!("{client_nonce}{}", B64.encode(nonce_bytes));
    let mut salt = [0u8; 16];
    rand::fill(&mut salt);
    let mut salted = [0u8; 32];
    pbkdf2::pbkdf2_hmac::<Sha256>(password.as_bytes(), &salt, ITERATIONS, &mut salted);
    let server_first = format!("r={nonce},s={},i={ITERATIONS}", B64.encode(salt));
    Ok((
        Exchange {
            salted,
            gs2_header: format!("{cbind},{authzid},"),
            nonce,
            client_first_bare: bare.to_owned(),
            server_first: server_first.clone(),
        },
        server_first,
    ))
}

impl Exchange {
    /// Checks the client's proof; returns the server's final message.
    pub fn finish(self, client_final: &str) -> Result<String, String> {
        let (without_proof, proof) = client_final
            .rsplit_once(",p=")
            .ok_or("client-final-message without a proof")?;
        let binding = attribute(without_proof, 'c').ok_or("client-final-message without c=")?;
        if B64.decode(binding).ok().as_deref() != Some(self.gs2_header.as_bytes()) {
            return Err("channel binding data does not match".into());
        }
        if attribute(without_proof, 'r') != Some(self.nonce.as_str()) {
            return Err("nonce does not match".into());
        }
        let proof = B64.decode(proof).map_err(|_| "proof is not base64")?;
        if proof.len() != 32 {
            return Err("proof has the wrong length".into());
        }
        let auth_message = format!(
            "{},{},{without_proof}",
            self.client_first_bare, self.server_first
        );
        let client_key = hmac(&self.salted, b"Client Key");
        let stored_key: [u8; 32] = Sha256::digest(client_key).into();
        let signature = hmac(&stored_key, auth_message.as_bytes());
        let recovered: Vec<u8> = proof.iter().zip(signature).map(|(p, s)| p ^ s).collect();
        let recovered_stored: [u8; 32] = Sha256::digest(&recovered).into();
        // Constant time: every byte is compared.
        let diff = recovered_stored
            .iter()
            .zip(stored_key)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff != 0 {
            return Err("password authentication failed".into());
        }
        let server_key = hmac(&self.salted, b"Server Key");
        let server_signature = hmac(&server_key, auth_message.as_bytes());
        Ok(format!("v={}", B64.encode(server_signature)))
    }
}

fn attribute(message: &str, name: char) -> Option<&str> {
    message
        .split(',')
        .find_map(|a| a.strip_prefix(name)?.strip_prefix('='))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The client side, as RFC 5802 describes it.
    fn client_final(password: &str, client_first_bare: &str, server_first: &str) -> String {
        let salt = B64.decode(attribute(server_first, 's').unwrap()).unwrap();
        let iterations: u32 = attribute(server_first, 'i').unwrap().parse().unwrap();
        let nonce = attribute(server_first, 'r').unwrap();
        let mut salted = [0u8; 32];
        pbkdf2::pbkdf2_hmac::<Sha256>(password.as_bytes(), &salt, iterations, &mut salted);
        let without_proof = format!("c=biws,r={nonce}");
        let auth = format!("{client_first_bare},{server_first},{without_proof}");
        let client_key = hmac(&salted, b"Client Key");
        let stored: [u8; 32] = Sha256::digest(client_key).into();
        let signature = hmac(&stored, auth.as_bytes());
        let proof: Vec<u8> = client_key
            .iter()
            .zip(signature)
            .map(|(k, s)| k ^ s)
            .collect();
        format!("{without_proof},p={}", B64.encode(proof))
    }

    #[test]
    fn right_password_passes_wrong_one_fails() {
        for (tried, ok) in [("secret", true), ("wrong", false)] {
            let (exchange, first) = server_first("secret", "n,,n=,r=abc").unwrap();
            assert!(first.starts_with("r=abc"));
            let result = exchange.finish(&client_final(tried, "n=,r=abc", &first));
            assert_eq!(result.is_ok(), ok, "{result:?}");
        }
    }

    #[test]
    fn channel_binding_and_garbage_are_refused() {
        assert!(server_first("s", "p=tls-server-end-point,,n=,r=abc").is_err());
        assert!(server_first("s", "garbage").is_err());
        assert!(server_first("s", "n,,n=").is_err());
        let (exchange, _) = server_first("s", "n,,n=,r=abc").unwrap();
        assert!(exchange.finish("c=biws,r=other,p=AAAA").is_err());
    }
}
