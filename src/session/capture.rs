//! A forwarded read's response, copied for the cache as it is relayed.

use bytes::BytesMut;

use crate::cache::Fill;
use crate::protocol::backend as be;

pub(super) struct Capture {
    fill: Fill,
    buf: BytesMut,
    ok: bool,
}

impl Capture {
    pub fn new(fill: Fill) -> Self {
        Self {
            fill,
            buf: BytesMut::new(),
            ok: true,
        }
    }

    /// Copies one response frame, or gives up on storing the response:
    /// only RowDescription, DataRow, CommandComplete and the like are
    /// replayable; anything that reports, notifies or starts a COPY is not.
    pub fn add(&mut self, frame: &[u8], max: usize) {
        let storable = !matches!(
            frame[0],
            be::ERROR_RESPONSE
                | be::NOTICE_RESPONSE
                | be::PARAMETER_STATUS
                | be::COPY_IN_RESPONSE
                | be::COPY_OUT_RESPONSE
                | be::COPY_BOTH_RESPONSE
                | be::PORTAL_SUSPENDED
                | be::COPY_DATA
                | be::COPY_DONE
        );
        if self.ok && storable && self.buf.len() + frame.len() <= max {
            self.buf.extend_from_slice(frame);
        } else if self.ok {
            self.ok = false;
            self.buf = BytesMut::new();
        }
    }

    /// The fill and the response, if it can be stored.
    pub fn finish(self) -> Option<(Fill, BytesMut)> {
        self.ok.then_some((self.fill, self.buf))
    }
}
