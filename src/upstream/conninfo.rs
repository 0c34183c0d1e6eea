//! libpq connection strings, as URLs (`postgres://...?k=v`) or `key=value`
//! pairs: what tokio-postgres would only call "invalid", named, and the
//! parameters pgcache honours itself taken out.

use super::UpstreamError;

/// The ports of a URL's hosts (`postgres://user@h1:5432,[::1]:5433/db`)
/// are numbers from 1 to 65535: tokio-postgres says only "invalid
/// connection string" of one that is not.
pub(super) fn check_ports(url: &str) -> Result<(), UpstreamError> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let hosts = authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts);
    for host in hosts.split(',') {
        // After an IPv6 address's closing bracket, or the last colon.
        let port = match host.rsplit_once(']') {
            Some((_, after)) => after.strip_prefix(':'),
            None => host.rsplit_once(':').map(|(_, port)| port),
        };
        if let Some(port) = port
            && !port.is_empty()
            && port.parse::<u16>().ok().is_none_or(|p| p == 0)
        {
            return Err(UpstreamError::Port(port.to_owned()));
        }
    }
    Ok(())
}

/// Takes the parameters named in `keys` out of a libpq URL
/// (`postgres://...?k=v&...`) or key=value string, returning the rest and
/// the (key, decoded value) pairs taken.
pub(super) fn split_params(url: &str, keys: &[&str]) -> Result<Split, UpstreamError> {
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if let Some((scheme, _)) = url.split_once("://")
        && !is_url
    {
        return Err(UpstreamError::Scheme(format!("{scheme}://")));
    }
    if is_url {
        check_ports(url)?;
        return split_url(url, keys);
    }
    split_keywords(url, keys)
}

/// What is left of a connection string, and the parameters taken out.
type Split = (String, Vec<(String, String)>);

/// [`split_params`] of a URL: parameters after `?`, percent-encoded.
fn split_url(url: &str, keys: &[&str]) -> Result<Split, UpstreamError> {
    let mut taken = Vec::new();
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), taken));
    };
    let mut kept = Vec::new();
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if keys.contains(&key) {
            let value = percent_encoding::percent_decode_str(value)
                .decode_utf8()
                .map_err(|e| UpstreamError::Param {
                    key: key.to_owned(),
                    reason: e.to_string(),
                })?;
            taken.push((key.to_owned(), value.into_owned()));
        } else {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((rest, taken))
}

/// [`split_params`] of `key = value` pairs; a value may be 'quoted' with
/// `\'` and `\\` escapes.
fn split_keywords(url: &str, keys: &[&str]) -> Result<Split, UpstreamError> {
    let mut taken = Vec::new();
    let mut rest = String::new();
    let mut chars = url.char_indices().peekable();
    loop {
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let Some(&(start, _)) = chars.peek() else {
            break;
        };
        let mut key = String::new();
        while let Some((_, c)) = chars.next_if(|(_, c)| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        if chars.next_if(|(_, c)| *c == '=').is_none() {
            return Err(UpstreamError::MissingEquals(key));
        }
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if(|(_, c)| *c == '\'').is_some() {
            loop {
                match chars.next() {
                    Some((_, '\\')) => match chars.next() {
                        Some((_, c)) => value.push(c),
                        None => return Err(UpstreamError::Unterminated),
                    },
                    Some((_, '\'')) => break,
                    Some((_, c)) => value.push(c),
                    None => return Err(UpstreamError::Unterminated),
                }
            }
        } else {
            while let Some((_, c)) = chars.next_if(|(_, c)| !c.is_whitespace()) {
                value.push(c);
            }
        }
        let end = chars.peek().map_or(url.len(), |&(i, _)| i);
        if keys.contains(&key.as_str()) {
            taken.push((key, value));
        } else {
            rest.push_str(url[start..end].trim_end());
            rest.push(' ');
        }
    }
    Ok((rest.trim_end().to_owned(), taken))
}
