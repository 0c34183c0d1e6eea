//! PostgreSQL wire protocol: bytes only, no sockets.
//!
//! pgcache relays *raw frames*: a frame is the tag byte, the 4-byte length and
//! the body, exactly as they arrived. Bodies are decoded only where the session
//! must look inside (startup parameters, BackendKeyData, ParameterStatus,
//! ReadyForQuery); everything else is passed on byte for byte, so encodings,
//! unknown message types and future protocol additions survive the trip.

pub mod answer;
pub mod codec;
pub mod encoding;
pub mod extended;
pub mod messages;
pub mod sqlstate;
pub mod startup;
pub mod stream;

pub use codec::{FrameError, parse_frame};

/// Frontend (client → server) message tags.
pub mod frontend {
    pub const QUERY: u8 = b'Q';
    pub const PARSE: u8 = b'P';
    pub const BIND: u8 = b'B';
    pub const EXECUTE: u8 = b'E';
    pub const DESCRIBE: u8 = b'D';
    pub const CLOSE: u8 = b'C';
    pub const SYNC: u8 = b'S';
    pub const FLUSH: u8 = b'H';
    pub const FUNCTION_CALL: u8 = b'F';
    pub const COPY_DATA: u8 = b'd';
    pub const COPY_DONE: u8 = b'c';
    pub const COPY_FAIL: u8 = b'f';
    pub const TERMINATE: u8 = b'X';
    /// PasswordMessage, SASLInitialResponse and SASLResponse.
    pub const PASSWORD: u8 = b'p';
    /// Describe and Close name a prepared statement...
    pub const TARGET_STATEMENT: u8 = b'S';
    /// ...or a portal.
    pub const TARGET_PORTAL: u8 = b'P';
}

/// Backend (server → client) message tags.
pub mod backend {
    pub const AUTHENTICATION: u8 = b'R';
    pub const BACKEND_KEY_DATA: u8 = b'K';
    pub const PARAMETER_STATUS: u8 = b'S';
    pub const READY_FOR_QUERY: u8 = b'Z';
    pub const ERROR_RESPONSE: u8 = b'E';
    pub const NOTICE_RESPONSE: u8 = b'N';
    pub const NOTIFICATION: u8 = b'A';
    pub const NEGOTIATE_PROTOCOL_VERSION: u8 = b'v';
    pub const ROW_DESCRIPTION: u8 = b'T';
    pub const DATA_ROW: u8 = b'D';
    pub const COMMAND_COMPLETE: u8 = b'C';
    pub const COPY_IN_RESPONSE: u8 = b'G';
    pub const COPY_OUT_RESPONSE: u8 = b'H';
    pub const COPY_BOTH_RESPONSE: u8 = b'W';
    pub const COPY_DATA: u8 = b'd';
    pub const COPY_DONE: u8 = b'c';
    pub const PORTAL_SUSPENDED: u8 = b's';
    pub const PARSE_COMPLETE: u8 = b'1';
    pub const BIND_COMPLETE: u8 = b'2';
    pub const CLOSE_COMPLETE: u8 = b'3';
    pub const NO_DATA: u8 = b'n';
    pub const EMPTY_QUERY_RESPONSE: u8 = b'I';
}

/// Transaction status carried by ReadyForQuery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TxStatus {
    /// Not in a transaction block.
    #[default]
    Idle,
    /// In a transaction block.
    InTransaction,
    /// In a failed transaction block.
    Failed,
}

impl TxStatus {
    pub fn as_byte(self) -> u8 {
        match self {
            Self::Idle => b'I',
            Self::InTransaction => b'T',
            Self::Failed => b'E',
        }
    }

    pub fn from_byte(b: u8) -> Option<Self> {
        match b {
            b'I' => Some(Self::Idle),
            b'T' => Some(Self::InTransaction),
            b'E' => Some(Self::Failed),
            _ => None,
        }
    }
}
