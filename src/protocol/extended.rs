//! Bounds-checked views of the extended-protocol messages the cache inspects
//! (Parse, Bind, Describe, Execute, Close), and DataRow for pgcache's own
//! queries. pgwire's decoders are not used here: they panic on malformed
//! input, may read past a message into the next one, and decode strings
//! lossily (see docs/design.md). Every reader here returns `None`
//! on a short or malformed body instead.

use super::codec::{read_cstr, read_i32};

fn read_i16(buf: &[u8], pos: &mut usize) -> Option<i16> {
    let b = buf.get(*pos..*pos + 2)?;
    *pos += 2;
    Some(i16::from_be_bytes([b[0], b[1]]))
}

#[derive(Debug, PartialEq, Eq)]
pub struct Parse<'a> {
    pub name: &'a [u8],
    pub query: &'a [u8],
    /// The raw parameter-type section (count and OIDs), for the cache key.
    pub param_types: &'a [u8],
}

pub fn parse(body: &[u8]) -> Option<Parse<'_>> {
    let mut pos = 0;
    let name = read_cstr(body, &mut pos)?;
    let query = read_cstr(body, &mut pos)?;
    let start = pos;
    let n = read_i16(body, &mut pos)?;
    if n < 0 || body.len() != pos + 4 * n as usize {
        return None;
    }
    Some(Parse {
        name,
        query,
        param_types: &body[start..],
    })
}

/// The SQL text of a Query or Parse frame (header included): a Parse's
/// text comes after its statement's name, which is not SQL and must not be
/// scanned as such. Empty for a malformed frame or another message.
pub fn statement_text(frame: &[u8]) -> &[u8] {
    let Some(body) = frame.get(super::codec::HEADER_LEN..) else {
        return &[];
    };
    match frame[0] {
        super::frontend::QUERY => body.strip_suffix(&[0]).unwrap_or(body),
        super::frontend::PARSE => {
            let mut pos = 0;
            read_cstr(body, &mut pos)
                .and_then(|_name| read_cstr(body, &mut pos))
                .unwrap_or_default()
        }
        _ => &[],
    }
}

/// Only the portal and statement names of a Bind: what the session needs for
/// every Bind, without reading its parameters.
pub fn bind_names(body: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut pos = 0;
    let portal = read_cstr(body, &mut pos)?;
    let statement = read_cstr(body, &mut pos)?;
    Some((portal, statement))
}

/// A Bind read without collecting it: each parameter's format (one per
/// parameter, whatever the message's shorthand) and value goes to `param`
/// in order, and the result formats come back (one code when all are the
/// same, `0` when none are given). Nothing is collected: a request is
/// keyed as its Bind is read, where building and moving a struct of its
/// parameters cost more than hashing them. `None` if the body is
/// malformed; what `param` saw by then is to be dropped.
pub fn walk_bind<'a>(
    body: &'a [u8],
    mut param: impl FnMut(i16, Option<&'a [u8]>),
) -> Option<impl Iterator<Item = i16> + 'a> {
    let mut pos = 0;
    read_cstr(body, &mut pos)?;
    read_cstr(body, &mut pos)?;
    let nfmt = read_i16(body, &mut pos)?;
    let formats = body.get(pos..pos + 2 * nfmt.max(0) as usize)?;
    pos += formats.len();
    let nparams = read_i16(body, &mut pos)?;
    if nfmt < 0 || nparams < 0 || (nfmt > 1 && nfmt != nparams) {
        return None;
    }
    let code = |i: usize| i16::from_be_bytes([formats[2 * i], formats[2 * i + 1]]);
    for i in 0..nparams as usize {
        let format = match nfmt {
            0 => 0,
            1 => code(0),
            _ => code(i),
        };
        let len = read_i32(body, &mut pos)?;
        let value = match len {
            -1 => None,
            ..-1 => return None,
            _ => {
                let v = body.get(pos..pos + len as usize)?;
                pos += len as usize;
                Some(v)
            }
        };
        param(format, value);
    }
    // A negative count of result formats reads as none.
    let nres = read_i16(body, &mut pos)?;
    let results = body.get(pos..pos + 2 * nres.max(0) as usize)?;
    if pos + results.len() != body.len() {
        return None;
    }
    let codes = results
        .chunks_exact(2)
        .map(|c| i16::from_be_bytes([c[0], c[1]]));
    let first = codes.clone().next();
    let rest = match codes.clone().all(|c| Some(c) == first) {
        true => 0,
        false => usize::MAX,
    };
    Some(std::iter::once(first.unwrap_or(0)).chain(codes.skip(1).take(rest)))
}

/// Describe and Close: a kind byte ('S' statement, 'P' portal) and a name.
pub fn target(body: &[u8]) -> Option<(u8, &[u8])> {
    let (&kind, rest) = body.split_first()?;
    let mut pos = 0;
    let name = read_cstr(rest, &mut pos)?;
    (pos == rest.len() && (kind == b'S' || kind == b'P')).then_some((kind, name))
}

/// Execute: portal name and row limit (0 = all rows).
pub fn execute(body: &[u8]) -> Option<(&[u8], i32)> {
    let mut pos = 0;
    let portal = read_cstr(body, &mut pos)?;
    let max_rows = read_i32(body, &mut pos)?;
    (pos == body.len()).then_some((portal, max_rows))
}

/// A DataRow's columns as text (pgcache's own queries use text format).
pub fn data_row(body: &[u8]) -> Option<Vec<Option<String>>> {
    let mut pos = 0;
    let n = read_i16(body, &mut pos)?;
    let mut out = Vec::with_capacity(n.max(0) as usize);
    for _ in 0..n {
        let len = read_i32(body, &mut pos)?;
        if len < 0 {
            out.push(None);
        } else {
            let v = body.get(pos..pos + len as usize)?;
            pos += len as usize;
            out.push(Some(String::from_utf8_lossy(v).into_owned()));
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bind_body(fmts: &[i16], params: &[Option<&[u8]>], res: &[i16]) -> Vec<u8> {
        let mut b = b"portal\0stmt\0".to_vec();
        b.extend((fmts.len() as i16).to_be_bytes());
        for f in fmts {
            b.extend(f.to_be_bytes());
        }
        b.extend((params.len() as i16).to_be_bytes());
        for p in params {
            match p {
                None => b.extend((-1i32).to_be_bytes()),
                Some(v) => {
                    b.extend((v.len() as i32).to_be_bytes());
                    b.extend(*v);
                }
            }
        }
        b.extend((res.len() as i16).to_be_bytes());
        for r in res {
            b.extend(r.to_be_bytes());
        }
        b
    }

    /// What [`walk_bind`] hands over, collected.
    type Walked<'a> = (Vec<(i16, Option<&'a [u8]>)>, Vec<i16>);

    fn walked(body: &[u8]) -> Option<Walked<'_>> {
        let mut params = Vec::new();
        let results = walk_bind(body, |f, v| params.push((f, v)))?.collect();
        Some((params, results))
    }

    #[test]
    fn bind_normalises_formats_and_keeps_nulls_apart_from_empty() {
        let body = bind_body(&[1], &[Some(b"ab"), None, Some(b"")], &[1, 1, 1]);
        assert_eq!(bind_names(&body), Some((&b"portal"[..], &b"stmt"[..])));
        let (params, results) = walked(&body).unwrap();
        assert_eq!(
            params,
            [(1, Some(&b"ab"[..])), (1, None), (1, Some(&b""[..]))]
        );
        assert_eq!(results, [1]);
        let body2 = bind_body(&[], &[Some(b"x")], &[]);
        let (params2, results2) = walked(&body2).unwrap();
        assert_eq!(params2, [(0, Some(&b"x"[..]))]);
        assert_eq!(results2, [0]);
        let body3 = bind_body(&[0, 1], &[Some(b"x"), Some(b"y")], &[0, 1]);
        let (params3, results3) = walked(&body3).unwrap();
        assert_eq!(params3, [(0, Some(&b"x"[..])), (1, Some(&b"y"[..]))]);
        assert_eq!(results3, [0, 1]);
        // A negative count of result formats reads as none.
        let mut none = b"\0\0".to_vec();
        none.extend(0i16.to_be_bytes());
        none.extend(0i16.to_be_bytes());
        none.extend((-3i16).to_be_bytes());
        assert_eq!(walked(&none), Some((vec![], vec![0])));
    }

    #[test]
    fn malformed_binds_are_rejected_not_panics() {
        let good = bind_body(&[0], &[Some(b"abc")], &[0]);
        for cut in 0..good.len() {
            assert!(walked(&good[..cut]).is_none(), "cut at {cut}");
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(walked(&trailing).is_none());
        // Three formats for one parameter.
        assert!(walked(&bind_body(&[0, 0, 0], &[Some(b"a")], &[])).is_none());
        // A parameter claiming more bytes than there are.
        let mut lying = b"\0\0".to_vec();
        lying.extend(0i16.to_be_bytes());
        lying.extend(1i16.to_be_bytes());
        lying.extend(1000i32.to_be_bytes());
        lying.extend(b"x");
        assert!(walked(&lying).is_none());
        // A length below -1 (-1 is NULL).
        let mut negative = b"\0\0".to_vec();
        negative.extend(0i16.to_be_bytes());
        negative.extend(1i16.to_be_bytes());
        negative.extend((-2i32).to_be_bytes());
        negative.extend(0i16.to_be_bytes());
        assert!(walked(&negative).is_none());
    }

    #[test]
    fn parse_describe_execute_and_data_row() {
        let mut body = b"s1\0SELECT $1\0".to_vec();
        body.extend(1i16.to_be_bytes());
        body.extend(23i32.to_be_bytes());
        let p = parse(&body).unwrap();
        assert_eq!((p.name, p.query), (&b"s1"[..], &b"SELECT $1"[..]));
        assert_eq!(p.param_types.len(), 6);
        assert!(parse(&body[..body.len() - 1]).is_none());
        assert_eq!(target(b"Pp1\0"), Some((b'P', &b"p1"[..])));
        assert_eq!(target(b"Xp1\0"), None);
        let mut exec = b"\0".to_vec();
        exec.extend(0i32.to_be_bytes());
        assert_eq!(execute(&exec), Some((&b""[..], 0)));
        let mut row = 2i16.to_be_bytes().to_vec();
        row.extend(1i32.to_be_bytes());
        row.extend(b"a");
        row.extend((-1i32).to_be_bytes());
        assert_eq!(data_row(&row), Some(vec![Some("a".into()), None]));
        assert!(data_row(&row[..row.len() - 1]).is_none());
    }
}
