//! One leg of a connection as frames: a byte stream, its read buffer and the
//! largest frame it accepts.
//!
//! Both legs of a session (client and PostgreSQL), the admin console and the
//! authentication exchanges read through this type, so "one whole frame",
//! "a clean end of stream" and "a stream cut inside a frame" mean the same
//! everywhere. The relay loop reads with [`FramedStream::fill`], which is
//! cancel-safe (it only appends to the buffer), and walks the complete
//! frames in place with [`FramedStream::frame_len_at`] so that runs of
//! frames can be relayed without copying.

use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use futures_util::FutureExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::codec::{self, FrameError, parse_frame, split_frame};

/// Read granularity; a large frame reserves its whole length at once.
pub const READ_CHUNK: usize = 16 * 1024;
/// A buffer that grew for a large frame is given back past this size.
const SHRINK_ABOVE: usize = 1 << 20;

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The peer broke the framing (a bad or oversized length).
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The stream ended inside a frame.
    #[error("connection closed in the middle of a message")]
    Truncated,
}

pub struct FramedStream<S> {
    io: S,
    buf: BytesMut,
    max_frame: usize,
}

impl<S> FramedStream<S> {
    /// `buf` may already hold bytes read from `io`.
    pub fn new(io: S, buf: BytesMut, max_frame: usize) -> Self {
        Self { io, buf, max_frame }
    }

    pub fn get_ref(&self) -> &S {
        &self.io
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.io
    }

    pub fn max_frame(&self) -> usize {
        self.max_frame
    }

    pub fn set_max_frame(&mut self, max: usize) {
        self.max_frame = max;
    }

    /// The bytes read and not yet consumed.
    pub fn buffered(&self) -> &[u8] {
        &self.buf
    }

    pub fn buffer_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// The length of the complete frame starting at `pos` of the buffer,
    /// `Ok(None)` if it is not all there yet.
    pub fn frame_len_at(&self, pos: usize) -> Result<Option<usize>, FrameError> {
        parse_frame(&self.buf[pos..], self.max_frame)
    }

    /// Takes the first `len` buffered bytes out.
    pub fn split_to(&mut self, len: usize) -> BytesMut {
        self.buf.split_to(len)
    }

    /// Drops the first `len` buffered bytes.
    pub fn consume(&mut self, len: usize) {
        self.buf.advance(len);
    }

    /// Takes the first buffered frame out, if it is complete.
    pub fn next_frame(&mut self) -> Result<Option<BytesMut>, FrameError> {
        split_frame(&mut self.buf, self.max_frame)
    }

    /// Gives the buffer back while nothing is in it: an idle connection
    /// then holds none until its peer sends again ([`Self::fill`]).
    pub fn release_if_empty(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > 0 {
            self.buf = BytesMut::new();
        }
    }

    /// Gives memory back after a large frame, once the buffer is empty.
    pub fn shrink_if_empty(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > SHRINK_ABOVE {
            self.buf = BytesMut::with_capacity(READ_CHUNK);
        }
    }
}

impl<S: AsyncRead + Unpin> FramedStream<S> {
    /// Reads more bytes into the buffer: at least room for the rest of the
    /// frame being read (capped at the limit, so a lying length cannot
    /// allocate), else one chunk. Returns 0 at the end of the stream.
    /// Cancel-safe.
    pub async fn fill(&mut self) -> std::io::Result<usize> {
        std::future::poll_fn(|cx| self.poll_fill(cx)).await
    }

    /// [`Self::fill`] of a stream the caller may not hold (`held`), never
    /// ready while it holds none: for a driver that waits on a connection
    /// that comes and goes, with no future of its own in between.
    pub fn fill_held(held: &mut Option<Self>) -> impl Future<Output = std::io::Result<usize>> + '_ {
        std::future::poll_fn(move |cx| match held {
            Some(stream) => stream.poll_fill(cx),
            None => Poll::Pending,
        })
    }

    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        let missing = codec::missing_bytes(&self.buf).min(self.max_frame);
        self.buf.reserve(missing.max(READ_CHUNK));
        tokio_util::io::poll_read_buf(std::pin::Pin::new(&mut self.io), cx, &mut self.buf)
    }

    /// [`Self::fill`], but with no buffer while none is held
    /// ([`Self::release_if_empty`]): the first bytes are read on the stack,
    /// and a buffer is taken once they arrive. Cancel-safe.
    pub async fn fill_lazily(&mut self) -> std::io::Result<usize> {
        if self.buf.capacity() > 0 {
            return self.fill().await;
        }
        let mut first = [0u8; 64];
        let mut n = self.io.read(&mut first).await?;
        if n > 0 {
            self.buf.reserve(READ_CHUNK);
            self.buf.extend_from_slice(&first[..n]);
            // What arrived with them is read now too, as one read would
            // have: a request must not reach the session in pieces it
            // would not otherwise come in.
            if let Some(Ok(more)) = self.io.read_buf(&mut self.buf).now_or_never() {
                n += more;
            }
        }
        Ok(n)
    }

    /// Reads one whole frame. `Ok(None)`: the stream ended cleanly, between
    /// frames.
    pub async fn read_frame(&mut self) -> Result<Option<BytesMut>, ReadError> {
        Ok(self.wait_frame().await?.map(|len| self.buf.split_to(len)))
    }

    /// Reads until one whole frame is buffered and returns its length,
    /// leaving it in the buffer. `Ok(None)`: a clean end of stream.
    pub async fn wait_frame(&mut self) -> Result<Option<usize>, ReadError> {
        loop {
            if let Some(len) = self.frame_len_at(0)? {
                return Ok(Some(len));
            }
            if self.fill().await? == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(ReadError::Truncated)
                };
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> FramedStream<S> {
    /// Writes frames (one or several, already encoded) in one go.
    pub async fn write_all(&mut self, frames: &[u8]) -> std::io::Result<()> {
        self.io.write_all(frames).await
    }

    pub async fn shutdown(&mut self) -> std::io::Result<()> {
        self.io.shutdown().await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> FramedStream<S> {
    /// Ends the connection with `last` (the peer's FATAL error): written,
    /// the write side shut, then what the peer still sends read and
    /// dropped for at most `linger`. Unread input at close makes the
    /// kernel send a reset, which can destroy the error before the peer
    /// reads it.
    pub async fn close_with(&mut self, last: &[u8], linger: std::time::Duration) {
        if self.write_all(last).await.is_err() || self.shutdown().await.is_err() {
            return;
        }
        let _ = tokio::time::timeout(linger, async {
            loop {
                self.buf.clear();
                if !matches!(self.fill().await, Ok(n) if n > 0) {
                    break;
                }
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::messages;

    fn framed(input: &[u8], max: usize) -> FramedStream<tokio::io::DuplexStream> {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let input = input.to_vec();
        tokio::spawn(async move {
            // Byte by byte: every frame arrives split.
            for byte in input {
                if a.write_all(&[byte]).await.is_err() {
                    return;
                }
            }
        });
        FramedStream::new(b, BytesMut::new(), max)
    }

    #[tokio::test]
    async fn frames_split_across_reads_come_out_whole_then_a_clean_end() {
        let mut input = messages::query("SELECT 1").to_vec();
        input.extend_from_slice(&messages::SYNC);
        let mut s = framed(&input, 1024);
        assert_eq!(&s.read_frame().await.unwrap().unwrap()[..], &input[..14]);
        assert_eq!(&s.read_frame().await.unwrap().unwrap()[..], &messages::SYNC);
        assert!(s.read_frame().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn an_end_inside_a_frame_is_truncation_not_a_clean_end() {
        let input = messages::query("SELECT 1");
        let mut s = framed(&input[..7], 1024);
        assert!(matches!(s.read_frame().await, Err(ReadError::Truncated)));
    }

    #[tokio::test]
    async fn a_released_buffer_is_taken_again_with_everything_that_arrived() {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut s = FramedStream::new(b, BytesMut::with_capacity(READ_CHUNK), 1 << 20);
        s.release_if_empty();
        assert_eq!(s.buffer_mut().capacity(), 0, "idle: no buffer");
        // A batch larger than the first read on the stack, sent at once.
        let batch = messages::query(&"x".repeat(300));
        a.write_all(&batch).await.unwrap();
        let n = s.fill_lazily().await.unwrap();
        assert_eq!(n, batch.len(), "all of what arrived, in one fill");
        assert_eq!(s.buffered(), &batch[..]);
        assert!(s.buffer_mut().capacity() >= READ_CHUNK);
        drop(a);
        s.consume(batch.len());
        s.release_if_empty();
        assert_eq!(s.fill_lazily().await.unwrap(), 0, "a clean end");
    }

    #[tokio::test]
    async fn an_oversized_frame_is_refused_from_its_header() {
        let input = messages::query(&"x".repeat(100));
        let mut s = framed(&input[..5], 50);
        assert!(matches!(
            s.read_frame().await,
            Err(ReadError::Frame(FrameError::TooLarge { .. }))
        ));
    }
}
