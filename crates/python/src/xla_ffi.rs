//! The part of XLA's FFI C API (`xla/ffi/api/c_api.h`, shipped in jaxlib's `include/`; API
//! version 0.3) that a CPU custom call needs: the call frame with its buffers and attributes,
//! the metadata query XLA sends before the first call, and errors. The layouts are the header's,
//! field for field (`#[repr(C)]`); only what flashgrpo's handlers read is declared, so the structs
//! that XLA owns are never built or sized here, only read through XLA's pointers.

use std::ffi::{c_char, c_void, CString};

pub const API_MAJOR: i32 = 0;
pub const API_MINOR: i32 = 3;

const EXTENSION_METADATA: i32 = 1;
const STAGE_EXECUTE: i32 = 3;
const ATTR_STRING: i32 = 4;
const ERROR_INVALID_ARGUMENT: i32 = 3;

pub const DTYPE_S32: i32 = 4;
pub const DTYPE_S64: i32 = 5;
pub const DTYPE_F16: i32 = 10;
pub const DTYPE_F32: i32 = 11;
pub const DTYPE_BF16: i32 = 16;

#[repr(C)]
pub struct ExtensionBase {
    pub struct_size: usize,
    pub kind: i32,
    pub next: *mut ExtensionBase,
}

#[repr(C)]
pub struct ApiVersion {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub major_version: i32,
    pub minor_version: i32,
}

#[repr(C)]
struct Metadata {
    struct_size: usize,
    api_version: ApiVersion,
    traits: u32,
}

#[repr(C)]
struct MetadataExtension {
    extension_base: ExtensionBase,
    metadata: *mut Metadata,
}

/// An opaque XLA error.
pub enum Error {}

#[repr(C)]
struct ErrorCreateArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    message: *const c_char,
    errc: i32,
}

/// The head of `XLA_FFI_Api`: enough to reach `XLA_FFI_Error_Create`.
#[repr(C)]
pub struct Api {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    api_version: ApiVersion,
    internal_api: *const c_void,
    error_create: unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut Error,
}

#[repr(C)]
pub struct Buffer {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub dtype: i32,
    pub data: *mut c_void,
    pub rank: i64,
    pub dims: *const i64,
}

#[repr(C)]
struct List {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    size: i64,
    types: *const i32,
    items: *mut *mut c_void,
}

#[repr(C)]
struct ByteSpan {
    ptr: *const c_char,
    len: usize,
}

#[repr(C)]
struct Attrs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    size: i64,
    types: *const i32,
    names: *const *const ByteSpan,
    attrs: *const *const c_void,
}

#[repr(C)]
pub struct CallFrame {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    api: *const Api,
    ctx: *mut c_void,
    stage: i32,
    args: List,
    rets: List,
    attrs: Attrs,
}

/// A handler's view of one call.
pub struct Call<'a> {
    frame: &'a CallFrame,
}

/// What a handler does with a call frame: answers XLA's metadata query (the API version it was
/// built against), ignores the stages before execution, and runs `execute` at execution, turning
/// its error into an XLA error.
///
/// # Safety
/// `frame` is the call frame XLA passed to the handler.
pub unsafe fn handle(frame: *mut CallFrame, execute: impl FnOnce(&Call<'_>) -> Result<(), String>) -> *mut Error {
    let frame = unsafe { &*frame };
    let extension = frame.extension_start;
    if !extension.is_null() && unsafe { (*extension).kind } == EXTENSION_METADATA {
        let metadata = unsafe { &mut *(*(extension as *mut MetadataExtension)).metadata };
        metadata.api_version.major_version = API_MAJOR;
        metadata.api_version.minor_version = API_MINOR;
        metadata.traits = 0;
        return std::ptr::null_mut();
    }
    if frame.stage != STAGE_EXECUTE {
        return std::ptr::null_mut();
    }
    let call = Call { frame };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| execute(&call))) {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(message)) => unsafe { call.error(&message) },
        Err(_) => unsafe { call.error("flashgrpo: the kernel panicked") },
    }
}

impl Call<'_> {
    unsafe fn error(&self, message: &str) -> *mut Error {
        let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
        let mut args = ErrorCreateArgs {
            struct_size: std::mem::size_of::<ErrorCreateArgs>(),
            extension_start: std::ptr::null_mut(),
            message: message.as_ptr(),
            errc: ERROR_INVALID_ARGUMENT,
        };
        unsafe { ((*self.frame.api).error_create)(&mut args) }
    }

    fn buffer<'b>(list: &'b List, index: usize, what: &str) -> Result<&'b Buffer, String> {
        if index >= list.size as usize {
            return Err(format!("flashgrpo: the custom call has {} {what}s, expected more than {index}", list.size));
        }
        // SAFETY: XLA's list of `size` buffers (the only argument and result type there is).
        Ok(unsafe { &*(*list.items.add(index) as *const Buffer) })
    }

    /// Argument `index`.
    pub fn arg(&self, index: usize) -> Result<&Buffer, String> {
        Self::buffer(&self.frame.args, index, "argument")
    }

    /// Result `index`.
    pub fn ret(&self, index: usize) -> Result<&Buffer, String> {
        Self::buffer(&self.frame.rets, index, "result")
    }

    /// The string attribute `name`.
    pub fn string_attr(&self, name: &str) -> Result<&str, String> {
        let attrs = &self.frame.attrs;
        for i in 0..attrs.size as usize {
            // SAFETY: XLA's `size` attributes with their names.
            let (kind, span) = unsafe { (*attrs.types.add(i), &**attrs.names.add(i)) };
            let key = unsafe { std::slice::from_raw_parts(span.ptr as *const u8, span.len) };
            if key == name.as_bytes() {
                if kind != ATTR_STRING {
                    return Err(format!("flashgrpo: attribute `{name}` is not a string"));
                }
                let value = unsafe { &*(*attrs.attrs.add(i) as *const ByteSpan) };
                let bytes = unsafe { std::slice::from_raw_parts(value.ptr as *const u8, value.len) };
                return std::str::from_utf8(bytes).map_err(|e| format!("flashgrpo: attribute `{name}`: {e}"));
            }
        }
        Err(format!("flashgrpo: the custom call has no attribute `{name}`"))
    }
}

impl Buffer {
    pub fn dims(&self) -> &[i64] {
        if self.rank == 0 {
            return &[];
        }
        // SAFETY: XLA's `rank` dimensions.
        unsafe { std::slice::from_raw_parts(self.dims, self.rank as usize) }
    }

    pub fn len(&self) -> usize {
        self.dims().iter().product::<i64>() as usize
    }
}
