//! The channels a transaction-mode client listens on, and which of its
//! server connection's notifications it may be given.
//!
//! A client that sends `LISTEN` is pinned to its connection ([`Pin`]), so
//! that the connection never goes back to the pool listening. This is the
//! second line: the channels its LISTEN statements name are noted as they
//! go out (a scan of the text, in any shape: a simple Query, an unnamed or
//! a named Parse), and a NotificationResponse for any other channel is
//! withheld from the client. A connection that delivers one carries
//! another client's LISTEN, and is closed rather than given to anyone
//! else.
//!
//! [`Pin`]: super::marks::Pin

use std::collections::HashSet;

use super::marks::listened;
use crate::protocol::codec::{HEADER_LEN, read_cstr, read_i32};

/// What one client listens on, on the connection it holds.
#[derive(Debug, Default)]
pub struct Listens {
    channels: HashSet<Vec<u8>>,
    /// A LISTEN went out whose channel the scan could not read: any
    /// channel may be the client's.
    any: bool,
    /// A notification for a channel the client never listened on arrived:
    /// the connection carries another client's LISTEN.
    foreign: bool,
}

impl Listens {
    /// A statement text with a LISTEN in it goes out: its channels are the
    /// client's from now on (an UNLISTEN takes none away: PostgreSQL then
    /// sends nothing for them).
    pub fn note(&mut self, sql: &[u8]) {
        for channel in listened(sql) {
            match channel {
                Some(channel) => {
                    self.channels.insert(channel);
                }
                None => self.any = true,
            }
        }
    }

    /// The server completed a LISTEN. One whose text was not seen (a shape
    /// the scan missed) still listens for this client.
    pub fn completed(&mut self) {
        if self.channels.is_empty() {
            self.any = true;
        }
    }

    /// Whether the client gets this NotificationResponse (header
    /// included).
    pub fn admits(&mut self, frame: &[u8]) -> bool {
        let body = frame.get(HEADER_LEN..).unwrap_or_default();
        let mut pos = 0;
        let channel = read_i32(body, &mut pos).and_then(|_pid| read_cstr(body, &mut pos));
        let admitted = self.any || channel.is_some_and(|c| self.channels.contains(c));
        self.foreign |= !admitted;
        admitted
    }

    /// The connection delivered a notification the client did not listen
    /// for: it is closed rather than given back.
    pub fn carries_foreign(&self) -> bool {
        self.foreign
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::backend as be;
    use crate::protocol::codec::frame_of;

    fn notification(channel: &str) -> Vec<u8> {
        let mut out = bytes::BytesMut::new();
        frame_of(
            &mut out,
            be::NOTIFICATION,
            &[
                &7i32.to_be_bytes(),
                channel.as_bytes(),
                &[0],
                b"payload",
                &[0],
            ],
        );
        out.to_vec()
    }

    #[test]
    fn only_the_channels_listened_on_are_admitted() {
        let mut listens = Listens::default();
        assert!(!listens.admits(&notification("jobs")), "nothing listened");
        assert!(listens.carries_foreign());
        let mut listens = Listens::default();
        listens.note(b"LISTEN Jobs; listen \"Mixed Case\"");
        assert!(listens.admits(&notification("jobs")));
        assert!(listens.admits(&notification("Mixed Case")));
        assert!(!listens.carries_foreign());
        assert!(!listens.admits(&notification("Jobs")));
        assert!(!listens.admits(&notification("other")));
        assert!(listens.carries_foreign());
    }

    #[test]
    fn an_unread_listen_admits_any_channel() {
        let mut listens = Listens::default();
        listens.note(b"LISTEN /* a comment */ jobs");
        assert!(listens.admits(&notification("jobs")));
        let mut listens = Listens::default();
        listens.completed();
        assert!(listens.admits(&notification("anything")));
        let mut listens = Listens::default();
        listens.note(b"LISTEN jobs");
        listens.completed();
        assert!(!listens.admits(&notification("other")));
    }

    #[test]
    fn a_malformed_notification_is_withheld() {
        let mut listens = Listens::default();
        listens.note(b"LISTEN jobs");
        assert!(!listens.admits(&[be::NOTIFICATION, 0, 0, 0, 6, 0, 0]));
    }
}
