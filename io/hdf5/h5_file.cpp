// HDF5 implementation of io/hdf5/h5_file.hpp (compiled only when Tessera is built with HDF5).
// Every HDF5 call is checked; a failure becomes an IoError that names the file, the dataset, what
// was expected and what was found, followed by HDF5's most specific reason when it gave one.
// Only API calls whose signature is the same in HDF5 1.10, 1.12 and 1.14 are used (no
// H5Oget_info / H5Ovisit, whose versions differ). The public calls open files with the default
// serial driver even when the library is parallel HDF5; the detail:: calls of h5_transfer.hpp
// take the caller's property lists (the MPI-IO driver of h5_mpio.cpp).
#include "io/hdf5/h5_file.hpp"

#include <fmt/format.h>
#include <hdf5.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <new>
#include <utility>

#include "core/checked_math.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/host_allocator.hpp"
#include "io/hdf5/h5_handle.hpp"
#include "io/hdf5/h5_transfer.hpp"
#include "io/host_staging.hpp"

namespace tessera::io {
namespace {

using detail::attribute_handle;
using detail::file_handle;
using detail::H5Handle;
using detail::object_handle;
using detail::plist_handle;
using detail::space_handle;
using detail::type_handle;

constexpr const char* kOp = "hdf5";
/// Dataset attribute naming the Tessera dtype where the HDF5 type alone may not tell other readers.
constexpr const char* kDtypeAttribute = "tessera_dtype";
/// Chunks chosen for a compressed dataset without explicit chunks hold at most this many bytes.
constexpr size_t kAutoChunkBytes = size_t{1} << 20;
/// Attributes longer than this are rendered as their first elements and "...".
constexpr hssize_t kMaxRenderedElements = 16;

/// Serialises every call into HDF5 (it is usually built without thread safety, and local-backend
/// ranks are threads) and turns HDF5's automatic error-stack printing off. Printing stays off
/// afterwards (for the application's own HDF5 calls too): HDF5 1.10 prints "infinite loop closing
/// library" at exit after it met a corrupted object header (HDF5 issue #3790) unless printing is
/// off then. It is set on every call, not once, because a thread-safe HDF5 keeps it per thread.
/// Declared first in each public function, so it outlives every handle the function opens.
class Hdf5Call {
 public:
  Hdf5Call() : lock_(hdf5_mutex()) { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
  Hdf5Call(const Hdf5Call&) = delete;
  Hdf5Call& operator=(const Hdf5Call&) = delete;

 private:
  static std::mutex& hdf5_mutex() {
    static std::mutex mutex;
    return mutex;
  }

  std::lock_guard<std::mutex> lock_;
};

/// The file and dataset a call is about, named in every error message.
struct Where {
  std::string file;
  std::string dataset;  // normalised absolute path; "" for whole-file calls
};

/// The most specific message on HDF5's error stack (the stack of the last failed API call).
std::string hdf5_reason() {
  std::string reason;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned depth, const H5E_error2_t* error, void* data) -> herr_t {
        if (depth == 0 && error != nullptr && error->desc != nullptr)
          *static_cast<std::string*>(data) = error->desc;
        return 0;
      },
      &reason);
  return reason;
}

std::string location(const Where& where) {
  if (where.dataset.empty()) return fmt::format("file '{}'", where.file);
  return fmt::format("file '{}', dataset '{}'", where.file, where.dataset);
}

/// Throws IoError about `where`.
[[noreturn]] void fail(const Where& where, const std::string& what) {
  throw IoError(kOp, fmt::format("{}: {}", location(where), what));
}

/// Throws IoError about `where` after a failed HDF5 call, adding HDF5's own reason.
[[noreturn]] void fail_hdf5(const Where& where, const std::string& what) {
  const std::string reason = hdf5_reason();
  if (reason.empty()) fail(where, what);
  fail(where, fmt::format("{} (HDF5: {})", what, reason));
}

/// The components of a dataset path ("a//b/" -> {"a", "b"}); fails when there is none.
std::vector<std::string> path_components(const std::string& file, const std::string& dataset) {
  std::vector<std::string> components;
  size_t start = 0;
  while (start <= dataset.size()) {
    size_t end = dataset.find('/', start);
    if (end == std::string::npos) end = dataset.size();
    if (end > start) components.push_back(dataset.substr(start, end - start));
    start = end + 1;
  }
  if (components.empty())
    fail(Where{file, dataset}, "expected a dataset path such as '/group/name', found no name");
  return components;
}

/// "/a/b" from {"a", "b"}.
std::string join_path(const std::vector<std::string>& components, size_t count) {
  std::string path;
  for (size_t i = 0; i < count; ++i) path += "/" + components[i];
  return path;
}

// ---- files ---------------------------------------------------------------------------------

/// Fails unless `file` is an existing regular file with an HDF5 signature.
void require_hdf5_file(const Where& where) {
  std::error_code error;
  const auto status = std::filesystem::status(where.file, error);
  if (!std::filesystem::exists(status)) fail(where, "expected an HDF5 file, found no such file");
  if (std::filesystem::is_directory(status))
    fail(where, "expected an HDF5 file, found a directory");
  const htri_t is_hdf5 = H5Fis_hdf5(where.file.c_str());
  if (is_hdf5 < 0) fail_hdf5(where, "expected an HDF5 file, found a file that cannot be read");
  if (is_hdf5 == 0)
    fail(where, "expected an HDF5 file, found a file without the HDF5 signature (not HDF5)");
}

/// Opens an existing HDF5 file read-only (default serial driver unless `access` says otherwise).
/// Files opened through this layer (file_open_count).
std::atomic<int64_t> files_opened{0};

H5Handle open_for_read(const Where& where, hid_t access = H5P_DEFAULT) {
  require_hdf5_file(where);
  files_opened.fetch_add(1, std::memory_order_relaxed);
  H5Handle file = file_handle(H5Fopen(where.file.c_str(), H5F_ACC_RDONLY, access));
  if (!file.valid())
    fail_hdf5(where,
              "expected a readable HDF5 file, found one HDF5 cannot open "
              "(truncated or corrupted, or locked by a writer)");
  return file;
}

/// File access for writing: objects in the HDF5 1.10 formats, whose metadata (superblock, object
/// headers, chunk indexes) all carries checksums, so damage is reported instead of misread. HDF5
/// 1.10 and later (and h5py built on them) read these files; older formats stay readable here.
H5Handle write_file_access(const Where& where) {
  H5Handle access = plist_handle(H5Pcreate(H5P_FILE_ACCESS));
  if (!access.valid() || H5Pset_libver_bounds(access.get(), H5F_LIBVER_V110, H5F_LIBVER_V110) < 0)
    fail_hdf5(where, "cannot set up the file access property list");
  return access;
}

/// Opens `file` for writing: created when missing or when `truncate` is set, otherwise opened
/// read-write (it must then be an HDF5 file; other files are never overwritten silently).
H5Handle open_for_write(const Where& where, bool truncate) {
  std::error_code error;
  const auto status = std::filesystem::status(where.file, error);
  if (std::filesystem::is_directory(status))
    fail(where, "expected an HDF5 file to write, found a directory");
  H5Handle access = write_file_access(where);
  if (truncate || !std::filesystem::exists(status)) {
    const unsigned mode = truncate ? H5F_ACC_TRUNC : H5F_ACC_EXCL;
    H5Handle file = file_handle(H5Fcreate(where.file.c_str(), mode, H5P_DEFAULT, access.get()));
    if (!file.valid())
      fail_hdf5(where, "cannot create the file (does its directory exist and is it writable?)");
    return file;
  }
  const htri_t is_hdf5 = H5Fis_hdf5(where.file.c_str());
  if (is_hdf5 < 0) fail_hdf5(where, "expected an HDF5 file, found a file that cannot be read");
  if (is_hdf5 == 0)
    fail(where,
         "expected an HDF5 file to add the dataset to, found a file that is not HDF5 "
         "(set WriteOptions::truncate_file to replace it)");
  files_opened.fetch_add(1, std::memory_order_relaxed);
  H5Handle file = file_handle(H5Fopen(where.file.c_str(), H5F_ACC_RDWR, access.get()));
  if (!file.valid())
    fail_hdf5(where,
              "expected an HDF5 file open for writing, found one HDF5 cannot open "
              "(read-only, truncated, corrupted, or open elsewhere)");
  return file;
}

// ---- objects -------------------------------------------------------------------------------

enum class ObjectKind { none, group, dataset, datatype };

std::string_view kind_name(ObjectKind kind) {
  switch (kind) {
    case ObjectKind::none: return "nothing";
    case ObjectKind::group: return "a group";
    case ObjectKind::dataset: return "a dataset";
    case ObjectKind::datatype: return "a named datatype";
  }
  return "an object";
}

ObjectKind kind_of(hid_t object) {
  switch (H5Iget_type(object)) {
    case H5I_GROUP: return ObjectKind::group;
    case H5I_DATASET: return ObjectKind::dataset;
    default: return ObjectKind::datatype;
  }
}

/// What a path names: the object and its kind when it exists; otherwise the first prefix that is
/// missing or is not a group (`blocked_at`, with its kind in `blocked_kind`).
struct Lookup {
  ObjectKind kind = ObjectKind::none;
  H5Handle object;
  std::string blocked_at;
  ObjectKind blocked_kind = ObjectKind::none;
};

/// Follows `components` from the root group one link at a time (H5Lexists needs every
/// intermediate group to exist).
Lookup find_object(hid_t file, const Where& where, const std::vector<std::string>& components) {
  Lookup lookup;
  for (size_t count = 1; count <= components.size(); ++count) {
    const std::string prefix = join_path(components, count);
    const htri_t exists = H5Lexists(file, prefix.c_str(), H5P_DEFAULT);
    if (exists < 0) fail_hdf5(where, fmt::format("cannot look up '{}' (corrupted file?)", prefix));
    if (exists == 0) {
      lookup.blocked_at = prefix;
      return lookup;
    }
    H5Handle object = object_handle(H5Oopen(file, prefix.c_str(), H5P_DEFAULT));
    if (!object.valid())
      fail_hdf5(where, fmt::format("cannot open the object at '{}' (a dangling soft or external "
                                   "link, or a corrupted file)",
                                   prefix));
    const ObjectKind kind = kind_of(object.get());
    if (count == components.size()) {
      lookup.kind = kind;
      lookup.object = std::move(object);
      return lookup;
    }
    if (kind != ObjectKind::group) {
      lookup.blocked_at = prefix;
      lookup.blocked_kind = kind;
      return lookup;
    }
  }
  return lookup;
}

/// Opens the dataset at `components`; fails naming what is there instead.
H5Handle open_dataset(hid_t file, const Where& where, const std::vector<std::string>& components) {
  Lookup lookup = find_object(file, where, components);
  if (lookup.kind == ObjectKind::dataset) return std::move(lookup.object);
  if (lookup.kind != ObjectKind::none)
    fail(where, fmt::format("expected a dataset, found {}", kind_name(lookup.kind)));
  if (lookup.blocked_kind != ObjectKind::none)
    fail(where, fmt::format("expected a dataset, found that '{}' is {}, not a group",
                            lookup.blocked_at, kind_name(lookup.blocked_kind)));
  if (lookup.blocked_at == where.dataset)
    fail(where, "expected a dataset, found no object of that name");
  fail(where, fmt::format("expected a dataset, found no group '{}'", lookup.blocked_at));
}

// ---- element types -------------------------------------------------------------------------

/// What a file datatype is, in Tessera's terms.
struct ElementType {
  std::string name;             // "f32", ... or a description of an unsupported type
  std::optional<DType> dtype;   // set for the seven supported layouts
  bool numeric = false;         // integer or float class: HDF5 converts it to any dtype
  std::string_view class_name;  // "H5T_FLOAT", ...
};

/// Bit layout of an HDF5 float type.
struct FloatLayout {
  size_t bytes, sign_pos, exponent_pos, exponent_bits, mantissa_pos, mantissa_bits, bias;
  bool operator==(const FloatLayout&) const = default;
};

constexpr FloatLayout kF32Layout{4, 31, 23, 8, 0, 23, 127};
constexpr FloatLayout kF64Layout{8, 63, 52, 11, 0, 52, 1023};
constexpr FloatLayout kF16Layout{2, 15, 10, 5, 0, 10, 15};
constexpr FloatLayout kBF16Layout{2, 15, 7, 8, 0, 7, 127};

std::string_view class_name(H5T_class_t type_class) {
  switch (type_class) {
    case H5T_INTEGER: return "H5T_INTEGER";
    case H5T_FLOAT: return "H5T_FLOAT";
    case H5T_TIME: return "H5T_TIME";
    case H5T_STRING: return "H5T_STRING";
    case H5T_BITFIELD: return "H5T_BITFIELD";
    case H5T_OPAQUE: return "H5T_OPAQUE";
    case H5T_COMPOUND: return "H5T_COMPOUND";
    case H5T_REFERENCE: return "H5T_REFERENCE";
    case H5T_ENUM: return "H5T_ENUM";
    case H5T_VLEN: return "H5T_VLEN";
    case H5T_ARRAY: return "H5T_ARRAY";
    default: return "H5T_NO_CLASS";
  }
}

std::string_view class_description(H5T_class_t type_class) {
  switch (type_class) {
    case H5T_TIME: return "time";
    case H5T_STRING: return "string";
    case H5T_BITFIELD: return "bitfield";
    case H5T_OPAQUE: return "opaque";
    case H5T_COMPOUND: return "compound";
    case H5T_REFERENCE: return "reference";
    case H5T_ENUM: return "enum";
    case H5T_VLEN: return "variable-length sequence";
    case H5T_ARRAY: return "array";
    default: return "unknown";
  }
}

ElementType classify_integer(hid_t type) {
  const size_t bytes = H5Tget_size(type);
  const bool is_signed = H5Tget_sign(type) == H5T_SGN_2;
  ElementType element{fmt::format("{}{}", is_signed ? "i" : "u", bytes * 8), std::nullopt, true,
                      "H5T_INTEGER"};
  if (is_signed && bytes == 4) element.dtype = DType::i32;
  if (is_signed && bytes == 8) element.dtype = DType::i64;
  if (!is_signed && bytes == 1) element.dtype = DType::u8;
  return element;
}

ElementType classify_float(hid_t type) {
  FloatLayout layout{};
  layout.bytes = H5Tget_size(type);
  H5Tget_fields(type, &layout.sign_pos, &layout.exponent_pos, &layout.exponent_bits,
                &layout.mantissa_pos, &layout.mantissa_bits);
  layout.bias = H5Tget_ebias(type);
  const bool plain = H5Tget_norm(type) == H5T_NORM_IMPLIED && H5Tget_offset(type) == 0 &&
                     H5Tget_precision(type) == layout.bytes * 8;
  ElementType element{"", std::nullopt, true, "H5T_FLOAT"};
  if (plain && layout == kF32Layout) element.dtype = DType::f32;
  if (plain && layout == kF64Layout) element.dtype = DType::f64;
  if (plain && layout == kF16Layout) element.dtype = DType::f16;
  if (plain && layout == kBF16Layout) element.dtype = DType::bf16;
  if (element.dtype) {
    element.name = std::string(dtype_name(*element.dtype));
  } else if (layout.bytes == 2 || layout.bytes == 4 || layout.bytes == 8) {
    element.name = fmt::format(
        "{}-bit float with a non-standard layout (sign bit {}, {} exponent bits at {} with bias "
        "{}, {} mantissa bits at {})",
        layout.bytes * 8, layout.sign_pos, layout.exponent_bits, layout.exponent_pos, layout.bias,
        layout.mantissa_bits, layout.mantissa_pos);
  } else {
    element.name = fmt::format("{}-bit float", layout.bytes * 8);
  }
  return element;
}

ElementType classify_type(hid_t type) {
  const H5T_class_t type_class = H5Tget_class(type);
  if (type_class == H5T_INTEGER) return classify_integer(type);
  if (type_class == H5T_FLOAT) return classify_float(type);
  return ElementType{std::string(class_description(type_class)), std::nullopt, false,
                     class_name(type_class)};
}

/// A 16-bit float type derived from a 32-bit one (the recipe h5py uses for float16).
H5Handle sixteen_bit_float(hid_t base, const FloatLayout& layout) {
  H5Handle type = type_handle(H5Tcopy(base));
  if (!type.valid() ||
      H5Tset_fields(type.get(), layout.sign_pos, layout.exponent_pos, layout.exponent_bits,
                    layout.mantissa_pos, layout.mantissa_bits) < 0 ||
      H5Tset_size(type.get(), layout.bytes) < 0 || H5Tset_ebias(type.get(), layout.bias) < 0 ||
      H5Tset_precision(type.get(), layout.bytes * 8) < 0)
    return H5Handle();
  return type;
}

/// The HDF5 type of `dtype` in memory (native byte order) or in files we write (little-endian).
H5Handle hdf5_type(DType dtype, bool in_memory, const Where& where) {
  H5Handle type;
  switch (dtype) {
    case DType::f32:
      type = type_handle(H5Tcopy(in_memory ? H5T_NATIVE_FLOAT : H5T_IEEE_F32LE));
      break;
    case DType::f64:
      type = type_handle(H5Tcopy(in_memory ? H5T_NATIVE_DOUBLE : H5T_IEEE_F64LE));
      break;
    case DType::i32:
      type = type_handle(H5Tcopy(in_memory ? H5T_NATIVE_INT32 : H5T_STD_I32LE));
      break;
    case DType::i64:
      type = type_handle(H5Tcopy(in_memory ? H5T_NATIVE_INT64 : H5T_STD_I64LE));
      break;
    case DType::u8: type = type_handle(H5Tcopy(in_memory ? H5T_NATIVE_UINT8 : H5T_STD_U8LE)); break;
    case DType::f16:
      type = sixteen_bit_float(in_memory ? H5T_NATIVE_FLOAT : H5T_IEEE_F32LE, kF16Layout);
      break;
    case DType::bf16:
      type = sixteen_bit_float(in_memory ? H5T_NATIVE_FLOAT : H5T_IEEE_F32LE, kBF16Layout);
      break;
  }
  if (!type.valid())
    fail_hdf5(where, fmt::format("cannot build the HDF5 type of {}", dtype_name(dtype)));
  return type;
}

// ---- dataspaces and properties -------------------------------------------------------------

/// The shape of a dataspace: {} for a scalar, {0} for a null (empty) dataspace.
Shape dataspace_shape(hid_t space, const Where& where) {
  const H5S_class_t space_class = H5Sget_simple_extent_type(space);
  if (space_class == H5S_SCALAR) return {};
  if (space_class == H5S_NULL) return {0};
  const int rank = H5Sget_simple_extent_ndims(space);
  if (space_class != H5S_SIMPLE || rank < 0)
    fail_hdf5(where, "expected a simple dataspace, found one HDF5 cannot describe");
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  if (rank > 0 && H5Sget_simple_extent_dims(space, dims.data(), nullptr) < 0)
    fail_hdf5(where, "cannot read the dataset extents");
  // A damaged file can declare any extents: refuse what no tensor could hold before any size is
  // computed from them.
  for (hsize_t extent : dims)
    if (extent > static_cast<hsize_t>(kMaxTensorSize))
      fail(where, fmt::format("expected dataset extents of at most {}, found shape ({})",
                              kMaxTensorSize, fmt::join(dims, ", ")));
  Shape shape(dims.begin(), dims.end());
  try {
    checked_numel(shape, "hdf5", "dataset shape");
  } catch (const InvalidArgument&) {
    fail(where, fmt::format("expected a dataset shape of at most {} elements, found shape ({})",
                            kMaxTensorSize, fmt::join(shape, ", ")));
  }
  return shape;
}

Shape dataset_shape(hid_t dataset, const Where& where) {
  H5Handle space = space_handle(H5Dget_space(dataset));
  if (!space.valid()) fail_hdf5(where, "cannot read the dataspace (corrupted file?)");
  return dataspace_shape(space.get(), where);
}

ElementType dataset_element_type(hid_t dataset, const Where& where) {
  H5Handle type = type_handle(H5Dget_type(dataset));
  if (!type.valid()) fail_hdf5(where, "cannot read the element type (corrupted file?)");
  return classify_type(type.get());
}

/// "gzip(4)", "shuffle", ... for one filter of a dataset creation property list.
std::string filter_description(hid_t creation, unsigned index, const Where& where) {
  unsigned flags = 0, config = 0;
  size_t value_count = 8;
  unsigned values[8] = {};
  char name[256] = {};
  const H5Z_filter_t filter =
      H5Pget_filter2(creation, index, &flags, &value_count, values, sizeof name, name, &config);
  switch (filter) {
    case H5Z_FILTER_DEFLATE:
      return value_count > 0 ? fmt::format("gzip({})", values[0]) : std::string("gzip");
    case H5Z_FILTER_SHUFFLE: return "shuffle";
    case H5Z_FILTER_FLETCHER32: return "fletcher32";
    case H5Z_FILTER_SZIP: return "szip";
    case H5Z_FILTER_NBIT: return "nbit";
    case H5Z_FILTER_SCALEOFFSET: return "scaleoffset";
    case H5Z_FILTER_ERROR: fail_hdf5(where, "cannot read the filter pipeline");
    default: return name[0] != '\0' ? fmt::format("{}", name) : fmt::format("filter {}", filter);
  }
}

/// Fills the chunk extents and the filter pipeline of `info` from the dataset's creation list.
void describe_storage(hid_t dataset, const Where& where, DatasetInfo& info) {
  H5Handle creation = plist_handle(H5Dget_create_plist(dataset));
  if (!creation.valid()) fail_hdf5(where, "cannot read the dataset creation properties");
  if (H5Pget_layout(creation.get()) == H5D_CHUNKED) {
    std::vector<hsize_t> chunk(H5S_MAX_RANK);
    const int rank = H5Pget_chunk(creation.get(), H5S_MAX_RANK, chunk.data());
    if (rank < 0) fail_hdf5(where, "cannot read the chunk extents");
    info.chunks = Shape(chunk.begin(), chunk.begin() + rank);
  }
  const int filters = H5Pget_nfilters(creation.get());
  if (filters < 0) fail_hdf5(where, "cannot read the filter pipeline");
  for (int index = 0; index < filters; ++index) {
    if (!info.compression.empty()) info.compression += "+";
    info.compression += filter_description(creation.get(), static_cast<unsigned>(index), where);
  }
}

// ---- attributes ----------------------------------------------------------------------------

/// "v" for one element, "[a, b, ...]" for several (at most kMaxRenderedElements shown).
std::string render_elements(const std::vector<std::string>& elements, hssize_t total, bool scalar) {
  if (scalar && elements.size() == 1) return elements[0];
  std::string text = "[";
  for (size_t i = 0; i < elements.size(); ++i) text += (i ? ", " : "") + elements[i];
  if (total > static_cast<hssize_t>(elements.size())) text += ", ...";
  return text + "]";
}

std::vector<std::string> read_string_attribute(hid_t attribute, hid_t file_type, hssize_t count,
                                               const Where& where) {
  std::vector<std::string> strings;
  H5Handle memory = type_handle(H5Tcopy(H5T_C_S1));
  if (!memory.valid() || H5Tset_cset(memory.get(), H5Tget_cset(file_type)) < 0)
    fail_hdf5(where, "cannot build a string type");
  const htri_t variable = H5Tis_variable_str(file_type);
  if (variable > 0) {
    std::vector<char*> pointers(static_cast<size_t>(count), nullptr);
    if (H5Tset_size(memory.get(), H5T_VARIABLE) < 0 ||
        H5Aread(attribute, memory.get(), pointers.data()) < 0)
      fail_hdf5(where, "cannot read a string attribute");
    for (char* pointer : pointers) {
      strings.emplace_back(pointer != nullptr ? pointer : "");
      if (pointer != nullptr) H5free_memory(pointer);
    }
    return strings;
  }
  const size_t size = H5Tget_size(file_type);
  std::vector<char> buffer(static_cast<size_t>(count) * size + 1, '\0');
  if (size == 0 || H5Tset_size(memory.get(), size) < 0 ||
      H5Tset_strpad(memory.get(), H5T_STR_NULLPAD) < 0 ||
      H5Aread(attribute, memory.get(), buffer.data()) < 0)
    fail_hdf5(where, "cannot read a string attribute");
  for (hssize_t i = 0; i < count; ++i) {
    const char* begin = buffer.data() + i * static_cast<hssize_t>(size);
    strings.emplace_back(begin, strnlen(begin, size));
  }
  return strings;
}

/// The value of one attribute as text: strings as they are, numbers in shortest form, other
/// types as "<class>".
std::string render_attribute(hid_t attribute, const Where& where) {
  H5Handle type = type_handle(H5Aget_type(attribute));
  H5Handle space = space_handle(H5Aget_space(attribute));
  if (!type.valid() || !space.valid()) fail_hdf5(where, "cannot read an attribute's type");
  const hssize_t count = H5Sget_simple_extent_npoints(space.get());
  if (count < 0) fail_hdf5(where, "cannot read an attribute's extent");
  const bool scalar = H5Sget_simple_extent_type(space.get()) == H5S_SCALAR;
  const H5T_class_t type_class = H5Tget_class(type.get());
  std::vector<std::string> elements;
  if (count == 0) return "[]";
  if (type_class == H5T_STRING) {
    elements = read_string_attribute(attribute, type.get(), count, where);
    if (static_cast<hssize_t>(elements.size()) > kMaxRenderedElements)
      elements.resize(kMaxRenderedElements);
  } else if (type_class == H5T_INTEGER || type_class == H5T_FLOAT) {
    const bool is_unsigned = type_class == H5T_INTEGER && H5Tget_sign(type.get()) == H5T_SGN_NONE;
    hid_t memory = type_class == H5T_FLOAT ? H5T_NATIVE_DOUBLE
                   : is_unsigned           ? H5T_NATIVE_UINT64
                                           : H5T_NATIVE_INT64;
    std::vector<uint64_t> values(static_cast<size_t>(count));  // 8 bytes per element
    if (H5Aread(attribute, memory, values.data()) < 0)
      fail_hdf5(where, "cannot read a numeric attribute");
    for (hssize_t i = 0; i < std::min(count, kMaxRenderedElements); ++i) {
      const void* value = &values[static_cast<size_t>(i)];
      if (type_class == H5T_FLOAT)
        elements.push_back(fmt::format("{}", *static_cast<const double*>(value)));
      else if (is_unsigned)
        elements.push_back(fmt::format("{}", *static_cast<const uint64_t*>(value)));
      else
        elements.push_back(fmt::format("{}", *static_cast<const int64_t*>(value)));
    }
  } else {
    return fmt::format("<{}>", class_description(type_class));
  }
  return render_elements(elements, count, scalar);
}

std::map<std::string, std::string> read_attributes(hid_t object, const Where& where) {
  std::vector<std::string> names;
  const herr_t status = H5Aiterate2(
      object, H5_INDEX_NAME, H5_ITER_INC, nullptr,
      [](hid_t, const char* name, const H5A_info_t*, void* data) -> herr_t {
        static_cast<std::vector<std::string>*>(data)->emplace_back(name);
        return 0;
      },
      &names);
  if (status < 0) fail_hdf5(where, "cannot list the attributes (corrupted file?)");
  std::map<std::string, std::string> attributes;
  for (const std::string& name : names) {
    H5Handle attribute = attribute_handle(H5Aopen(object, name.c_str(), H5P_DEFAULT));
    if (!attribute.valid()) fail_hdf5(where, fmt::format("cannot open attribute '{}'", name));
    attributes[name] = render_attribute(attribute.get(), where);
  }
  return attributes;
}

/// Writes a scalar fixed-length ASCII string attribute. Not variable-length: those live in a global
/// heap, which has no checksum, and HDF5 1.10 can crash reading a damaged one.
void write_string_attribute(hid_t object, const char* name, const std::string& value,
                            const Where& where) {
  H5Handle type = type_handle(H5Tcopy(H5T_C_S1));
  H5Handle space = space_handle(H5Screate(H5S_SCALAR));
  if (!type.valid() || !space.valid() || H5Tset_size(type.get(), value.size() + 1) < 0 ||
      H5Tset_strpad(type.get(), H5T_STR_NULLTERM) < 0)
    fail_hdf5(where, fmt::format("cannot build the type of attribute '{}'", name));
  H5Handle attribute =
      attribute_handle(H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT));
  if (!attribute.valid() || H5Awrite(attribute.get(), type.get(), value.c_str()) < 0)
    fail_hdf5(where, fmt::format("cannot write attribute '{}'", name));
}

// ---- datasets ------------------------------------------------------------------------------

DatasetInfo describe_dataset(hid_t dataset, const Where& where) {
  DatasetInfo info;
  info.path = where.dataset;
  info.shape = dataset_shape(dataset, where);
  const ElementType element = dataset_element_type(dataset, where);
  info.file_type = element.name;
  info.dtype = element.dtype;
  describe_storage(dataset, where, info);
  info.attributes = read_attributes(dataset, where);
  return info;
}

/// The dtype a read returns: `as` when given (the file type must then be numeric), otherwise the
/// dtype of the file type (which must be one of the seven).
DType read_dtype(const ElementType& element, std::optional<DType> as, const Where& where) {
  if (as) {
    if (!element.numeric)
      fail(where, fmt::format("expected a numeric element type to convert to {}, found {} (HDF5 "
                              "class {})",
                              dtype_name(*as), element.name, element.class_name));
    return *as;
  }
  if (!element.dtype)
    fail(where, fmt::format("expected an element type of f32, f64, f16, bf16, i32, i64 or u8, "
                            "found {} (HDF5 class {}){}",
                            element.name, element.class_name,
                            element.numeric ? "; pass a dtype to convert it on read" : ""));
  return *element.dtype;
}

/// Fails unless `box` has the dataset's rank and lies within [0, shape).
void check_box(const Box& box, const Shape& shape, const Where& where) {
  if (box.lo.size() != shape.size() || box.hi.size() != shape.size())
    fail(where, fmt::format("expected a {}-d box for a dataset of shape ({}), found {}-d box {}",
                            shape.size(), fmt::join(shape, ", "), box.lo.size(), box.str()));
  for (size_t d = 0; d < shape.size(); ++d)
    if (box.lo[d] < 0 || box.lo[d] > box.hi[d] || box.hi[d] > shape[d])
      fail(where, fmt::format("expected a box within the dataset shape ({}), found box {} "
                              "(dim {} is out of range)",
                              fmt::join(shape, ", "), box.str(), d));
}

/// An uninitialised cpu tensor for a read; a shape too large to hold (say, from damaged metadata
/// of a file without checksums) is an IoError raised before anything is allocated.
Tensor allocate_for_read(const Shape& shape, DType dtype, const Where& where) {
  uint64_t bytes = dtype_size(dtype);
  for (int64_t extent : shape)
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(extent), &bytes))
      bytes = std::numeric_limits<uint64_t>::max();
  try {
    if (bytes > host_memory_limit()) throw OutOfMemory("hdf5", "more than the host memory limit");
    return Tensor::empty(shape, dtype);
  } catch (const Error&) {
    fail(where, fmt::format("expected a selection that fits in memory (at most {} bytes), found "
                            "shape ({}) of {} ({} bytes)",
                            host_memory_limit(), fmt::join(shape, ", "), dtype_name(dtype), bytes));
  }
}

/// Selects `box` in `file_space` and returns a matching memory dataspace; with an empty box (in a
/// collective transfer) both select nothing.
H5Handle select_box(hid_t file_space, const Box& box, const Where& where) {
  const std::vector<hsize_t> start(box.lo.begin(), box.lo.end());
  const Shape extents = box.shape();
  const std::vector<hsize_t> count(extents.begin(), extents.end());
  H5Handle memory_space =
      space_handle(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr));
  if (!memory_space.valid()) fail_hdf5(where, "cannot create the memory dataspace");
  if (box.empty()) {
    if (H5Sselect_none(file_space) < 0 || H5Sselect_none(memory_space.get()) < 0)
      fail_hdf5(where, "cannot select nothing");
  } else if (H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start.data(), nullptr, count.data(),
                                 nullptr) < 0) {
    fail_hdf5(where, fmt::format("cannot select box {}", box.str()));
  }
  return memory_space;
}

/// One H5Dread or H5Dwrite between `host` and the box `file_box` of a dataset whose dataspace
/// (`file_space`) has `file_shape`; with no box this rank takes part selecting nothing (collective
/// transfers). Returns HDF5's status.
herr_t move_slab(bool write, hid_t dataset, hid_t file_space, const Shape& file_shape,
                 const std::optional<Box>& file_box, hid_t memory_type, hid_t transfer, void* host,
                 const Where& where) {
  H5Handle memory_space;
  if (!file_shape.empty()) {
    memory_space =
        select_box(file_space, file_box ? *file_box : Box{file_shape, file_shape}, where);
  } else if (!file_box) {
    // A scalar dataset: a rank that moves nothing selects nothing.
    memory_space = space_handle(H5Screate(H5S_SCALAR));
    if (!memory_space.valid() || H5Sselect_none(memory_space.get()) < 0 ||
        H5Sselect_none(file_space) < 0)
      fail_hdf5(where, "cannot select nothing");
  }
  const hid_t memory_space_id = memory_space.valid() ? memory_space.get() : H5S_ALL;
  const hid_t file_space_id = memory_space.valid() ? file_space : H5S_ALL;
  return write ? H5Dwrite(dataset, memory_type, memory_space_id, file_space_id, transfer, host)
               : H5Dread(dataset, memory_type, memory_space_id, file_space_id, transfer, host);
}

/// The slabs `box` moves in (boxes of the tensor, io/host_staging.hpp) for a tensor on `device`.
std::vector<Box> slabs_for(const Box& box, DType dtype, Device device) {
  return contiguous_slabs(box.shape(), dtype_size(dtype), io_slab_bytes(device));
}

/// `slab` (coordinates of a tensor holding `box`) in dataset coordinates.
Box shifted(const Box& slab, const Box& box) {
  Box global = slab;
  for (size_t d = 0; d < global.ndim(); ++d) {
    global.lo[d] += box.lo[d];
    global.hi[d] += box.lo[d];
  }
  return global;
}

/// Reads `box` (the whole dataset when null) of an open dataset into a new contiguous tensor on
/// `device`, slab by slab through host staging (one slab for a cpu tensor unless
/// TESSERA_IO_SLAB_BYTES is set).
Tensor read_open_dataset(hid_t dataset, const Where& where, const Box* box, std::optional<DType> as,
                         const detail::Transfer& how = {}, Device device = Device::cpu()) {
  H5Handle file_space = space_handle(H5Dget_space(dataset));
  if (!file_space.valid()) fail_hdf5(where, "cannot read the dataspace (corrupted file?)");
  const Shape shape = dataspace_shape(file_space.get(), where);
  const DType dtype = read_dtype(dataset_element_type(dataset, where), as, where);
  if (box != nullptr) check_box(*box, shape, where);
  const Box whole{Shape(shape.size(), 0), shape};
  const Box& selected = box != nullptr ? *box : whole;
  // Estimate mode (core/estimate/estimate_mode.hpp) reads the dataset's metadata only: the box
  // comes back shape-only, with the file's dtype (or `as`), and no element is read.
  if (estimate::active()) return Tensor::empty(selected.shape(), dtype, device);
  Tensor result = device.is_cpu() ? allocate_for_read(selected.shape(), dtype, where)
                                  : Tensor::empty(selected.shape(), dtype, device);
  if (result.numel() == 0 && !how.collective) return result;

  const H5Handle memory_type = hdf5_type(dtype, /*in_memory=*/true, where);
  const std::vector<Box> slabs =
      result.numel() == 0 ? std::vector<Box>{} : slabs_for(selected, dtype, device);
  std::vector<ByteRange> ranges;
  for (const Box& slab : slabs)
    ranges.push_back(byte_range_of(slab, result.shape(), dtype_size(dtype)));
  auto fail_read = [&](const Box& slab) {
    fail_hdf5(where, fmt::format("expected to read {} elements as {}, found data HDF5 cannot read "
                                 "(truncated or corrupted file?)",
                                 slab.volume(), dtype_name(dtype)));
  };
  stream_from_host(
      result, ranges,
      [&](size_t k, void* host) {
        if (move_slab(false, dataset, file_space.get(), shape, shifted(slabs[k], selected),
                      memory_type.get(), how.transfer, host, where) < 0)
          fail_read(slabs[k]);
      },
      "hdf5");
  // Collective transfers: as many calls as the rank with the most slabs makes.
  for (size_t k = slabs.size(); how.collective && k < how.calls; ++k)
    if (move_slab(false, dataset, file_space.get(), shape, std::nullopt, memory_type.get(),
                  how.transfer, nullptr, where) < 0)
      fail_read(Box{});
  return result;
}

/// Writes `tensor` (of `box`'s shape, any device) into `box` of an open dataset, slab by slab
/// through host staging; with `write_nothing` (collective transfers) this rank only takes part.
void write_open_dataset(hid_t dataset, hid_t file_space, const Shape& shape, const Box& box,
                        const Tensor& tensor, const detail::Transfer& how, bool write_nothing,
                        const Where& where) {
  const std::vector<Box> slabs = write_nothing || tensor.numel() == 0
                                     ? std::vector<Box>{}
                                     : slabs_for(box, tensor.dtype(), tensor.device());
  const H5Handle memory_type = hdf5_type(tensor.dtype(), /*in_memory=*/true, where);
  std::vector<ByteRange> ranges;
  for (const Box& slab : slabs)
    ranges.push_back(byte_range_of(slab, tensor.shape(), tensor.element_size()));
  stream_to_host(
      tensor, ranges,
      [&](size_t k, const void* host) {
        const Box written = shifted(slabs[k], box);
        if (move_slab(true, dataset, file_space, shape, written, memory_type.get(), how.transfer,
                      const_cast<void*>(host), where) < 0)
          fail_hdf5(where, fmt::format("cannot write {} elements of {} into box {}",
                                       slabs[k].volume(), tensor.str(), written.str()));
      },
      "hdf5");
  for (size_t k = slabs.size(); how.collective && k < how.calls; ++k)
    if (move_slab(true, dataset, file_space, shape, std::nullopt, memory_type.get(), how.transfer,
                  nullptr, where) < 0)
      fail_hdf5(where, "cannot take part in a collective write");
}

/// Chunk extents for `shape`: the requested ones clamped to the shape (HDF5 refuses chunks larger
/// than a fixed-size dataset), or, when none were requested, the whole shape halved along the
/// leading dims until a chunk holds at most kAutoChunkBytes.
std::vector<hsize_t> chunk_extents(const Shape& shape, const std::optional<Shape>& requested,
                                   size_t element_size) {
  std::vector<hsize_t> chunk(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t extent = std::max<int64_t>(shape[d], 1);
    chunk[d] = static_cast<hsize_t>(requested ? std::min((*requested)[d], extent) : extent);
  }
  if (requested) return chunk;
  auto chunk_bytes = [&] {
    size_t bytes = element_size;
    for (hsize_t extent : chunk) bytes *= extent;
    return bytes;
  };
  for (size_t d = 0; d < chunk.size() && chunk_bytes() > kAutoChunkBytes;) {
    if (chunk[d] == 1) {
      ++d;
      continue;
    }
    chunk[d] = (chunk[d] + 1) / 2;
  }
  return chunk;
}

/// True when `options` ask for chunked storage (explicit chunks, or a filter that needs chunks).
bool is_chunked(const WriteOptions& options) {
  return options.chunks.has_value() || options.gzip_level >= 0 || options.checksum;
}

/// The dataset creation properties for `options`: contiguous, or chunked (then gzip-compressed
/// and/or checksummed as asked).
/// Zero-element tensors are always stored contiguous (they have no data to chunk).
H5Handle creation_properties(const Shape& shape, size_t element_size, const WriteOptions& options,
                             const Where& where) {
  H5Handle creation = plist_handle(H5Pcreate(H5P_DATASET_CREATE));
  if (!creation.valid()) fail_hdf5(where, "cannot create a dataset creation property list");
  if (!is_chunked(options) || shape_numel(shape) == 0) return creation;
  const std::vector<hsize_t> chunk = chunk_extents(shape, options.chunks, element_size);
  if (H5Pset_chunk(creation.get(), static_cast<int>(chunk.size()), chunk.data()) < 0)
    fail_hdf5(where, fmt::format("cannot use chunks ({})", fmt::join(chunk, ", ")));
  if (options.gzip_level >= 0) {
    if (H5Zfilter_avail(H5Z_FILTER_DEFLATE) <= 0)
      fail(where, "expected gzip compression, found an HDF5 library built without it");
    if (H5Pset_deflate(creation.get(), static_cast<unsigned>(options.gzip_level)) < 0)
      fail_hdf5(where, fmt::format("cannot use gzip level {}", options.gzip_level));
  }
  // Last in the pipeline, so a damaged chunk is detected before it is decompressed.
  if (options.checksum && H5Pset_fletcher32(creation.get()) < 0)
    fail_hdf5(where, "cannot add the Fletcher-32 checksum filter");
  return creation;
}

/// Fails unless `options` can store a dataset of `ndim` dims (`what` names it in messages).
void check_write_options(int ndim, const std::string& what, const WriteOptions& options,
                         const Where& where) {
  if (options.gzip_level < -1 || options.gzip_level > 9)
    fail(where, fmt::format("expected gzip_level -1 (off) or 0..9, found {}", options.gzip_level));
  if (is_chunked(options) && ndim == 0)
    fail(where,
         "expected a tensor of rank >= 1 for a chunked, compressed or checksummed dataset, "
         "found a 0-d tensor");
  if (!options.chunks) return;
  const Shape& chunks = *options.chunks;
  if (static_cast<int>(chunks.size()) != ndim)
    fail(where, fmt::format("expected {} chunk extents for tensor {}, found ({})", ndim, what,
                            fmt::join(chunks, ", ")));
  if (std::any_of(chunks.begin(), chunks.end(), [](int64_t extent) { return extent <= 0; }))
    fail(where,
         fmt::format("expected positive chunk extents, found ({})", fmt::join(chunks, ", ")));
}

/// Makes `path` free for a new dataset: intermediate components must be groups (or missing, to be
/// created), and an existing dataset of that name is unlinked. A group there is never removed.
void clear_dataset_path(hid_t file, const Where& where,
                        const std::vector<std::string>& components) {
  Lookup lookup = find_object(file, where, components);
  if (lookup.blocked_kind != ObjectKind::none)
    fail(where, fmt::format("expected '{}' to be a group that can hold the dataset, found {}",
                            lookup.blocked_at, kind_name(lookup.blocked_kind)));
  if (lookup.kind == ObjectKind::none) return;
  if (lookup.kind != ObjectKind::dataset)
    fail(where, fmt::format("expected a dataset to replace (or nothing), found {}",
                            kind_name(lookup.kind)));
  lookup.object.close();
  if (H5Ldelete(file, where.dataset.c_str(), H5P_DEFAULT) < 0)
    fail_hdf5(where, "cannot remove the existing dataset of that name");
}

/// Creates `where.dataset` of `shape` and `dtype` in an open file (replacing a dataset of that
/// name), with the bf16 marker attribute; `what` names the tensor in messages.
H5Handle create_open_dataset(hid_t file, const Where& where,
                             const std::vector<std::string>& components, const Shape& shape,
                             DType dtype, const WriteOptions& options, const std::string& what) {
  clear_dataset_path(file, where, components);
  const std::vector<hsize_t> dims(shape.begin(), shape.end());
  H5Handle space = space_handle(
      shape.empty() ? H5Screate(H5S_SCALAR)
                    : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
  if (!space.valid()) fail_hdf5(where, fmt::format("cannot create a dataspace for {}", what));
  H5Handle creation = creation_properties(shape, dtype_size(dtype), options, where);
  H5Handle link_creation = plist_handle(H5Pcreate(H5P_LINK_CREATE));
  if (!link_creation.valid() || H5Pset_create_intermediate_group(link_creation.get(), 1) < 0)
    fail_hdf5(where, "cannot set up intermediate group creation");
  const H5Handle file_type = hdf5_type(dtype, /*in_memory=*/false, where);
  H5Handle object =
      object_handle(H5Dcreate2(file, where.dataset.c_str(), file_type.get(), space.get(),
                               link_creation.get(), creation.get(), H5P_DEFAULT));
  if (!object.valid()) fail_hdf5(where, fmt::format("cannot create a dataset for {}", what));
  if (dtype == DType::bf16) write_string_attribute(object.get(), kDtypeAttribute, "bf16", where);
  return object;
}

/// Opens an existing HDF5 file read-write (it is never created here); `access` replaces the
/// default file access list (it must then ask for the 1.10 formats itself, or not create objects).
H5Handle open_existing_for_write(const Where& where, hid_t access_list = H5P_DEFAULT) {
  require_hdf5_file(where);
  H5Handle access = write_file_access(where);
  H5Handle file = file_handle(H5Fopen(where.file.c_str(), H5F_ACC_RDWR,
                                      access_list == H5P_DEFAULT ? access.get() : access_list));
  if (!file.valid())
    fail_hdf5(where,
              "expected an HDF5 file open for writing, found one HDF5 cannot open "
              "(read-only, truncated, corrupted, or open elsewhere)");
  return file;
}

}  // namespace

std::vector<DatasetInfo> list_datasets(const std::string& file) {
  Hdf5Call call;
  const Where where{file, ""};
  H5Handle handle = open_for_read(where);
  std::vector<std::string> link_names;
  const herr_t status = H5Lvisit(
      handle.get(), H5_INDEX_NAME, H5_ITER_INC,
      [](hid_t, const char* name, const H5L_info_t* link, void* data) -> herr_t {
        if (link->type == H5L_TYPE_HARD)
          static_cast<std::vector<std::string>*>(data)->emplace_back(name);
        return 0;
      },
      &link_names);
  if (status < 0) fail_hdf5(where, "cannot walk the groups of the file (corrupted file?)");

  std::vector<DatasetInfo> datasets;
  for (const std::string& name : link_names) {
    const Where object_where{file, "/" + name};
    H5Handle object =
        object_handle(H5Oopen(handle.get(), object_where.dataset.c_str(), H5P_DEFAULT));
    if (!object.valid()) fail_hdf5(object_where, "cannot open the object (corrupted file?)");
    if (kind_of(object.get()) == ObjectKind::dataset)
      datasets.push_back(describe_dataset(object.get(), object_where));
  }
  std::sort(datasets.begin(), datasets.end(),
            [](const DatasetInfo& a, const DatasetInfo& b) { return a.path < b.path; });
  return datasets;
}

DatasetInfo dataset_info(const std::string& file, const std::string& dataset) {
  Hdf5Call call;
  const std::vector<std::string> components = path_components(file, dataset);
  const Where where{file, join_path(components, components.size())};
  H5Handle handle = open_for_read(where);
  H5Handle object = open_dataset(handle.get(), where, components);
  return describe_dataset(object.get(), where);
}

Tensor read_dataset(const std::string& file, const std::string& dataset, std::optional<DType> as,
                    Device device) {
  Hdf5Call call;
  const std::vector<std::string> components = path_components(file, dataset);
  const Where where{file, join_path(components, components.size())};
  H5Handle handle = open_for_read(where);
  H5Handle object = open_dataset(handle.get(), where, components);
  return read_open_dataset(object.get(), where, nullptr, as, {}, device);
}

Tensor read_hyperslab(const std::string& file, const std::string& dataset, const Box& box,
                      std::optional<DType> as, Device device) {
  return detail::read_hyperslab(file, dataset, box, as, {}, device);
}

Tensor detail::read_hyperslab(const std::string& file, const std::string& dataset, const Box& box,
                              std::optional<DType> as, const Transfer& how, Device device) {
  Hdf5Call call;
  const std::vector<std::string> components = path_components(file, dataset);
  const Where where{file, join_path(components, components.size())};
  H5Handle handle = open_for_read(where, how.file_access);
  H5Handle object = open_dataset(handle.get(), where, components);
  return read_open_dataset(object.get(), where, &box, as, how, device);
}

void write_dataset(const std::string& file, const std::string& dataset, const Tensor& tensor,
                   const WriteOptions& options) {
  Hdf5Call call;
  const std::vector<std::string> components = path_components(file, dataset);
  const Where where{file, join_path(components, components.size())};
  check_write_options(tensor.ndim(), tensor.str(), options, where);

  H5Handle handle = open_for_write(where, options.truncate_file);
  H5Handle object = create_open_dataset(handle.get(), where, components, tensor.shape(),
                                        tensor.dtype(), options, tensor.str());
  if (tensor.numel() > 0) {
    H5Handle file_space = space_handle(H5Dget_space(object.get()));
    if (!file_space.valid()) fail_hdf5(where, "cannot read the dataspace");
    write_open_dataset(object.get(), file_space.get(), tensor.shape(),
                       Box{Shape(tensor.ndim(), 0), tensor.shape()}, tensor, {}, false, where);
  }
  if (object.close() < 0) fail_hdf5(where, "cannot close the dataset");
  if (handle.close() < 0) fail_hdf5(where, "cannot flush and close the file (disk full?)");
}

void create_dataset(const std::string& file, const std::string& dataset, const Shape& shape,
                    DType dtype, const WriteOptions& options) {
  Hdf5Call call;
  const std::vector<std::string> components = path_components(file, dataset);
  const Where where{file, join_path(components, components.size())};
  if (std::any_of(shape.begin(), shape.end(), [](int64_t extent) { return extent < 0; }))
    fail(where, fmt::format("expected extents >= 0, found shape ({})", fmt::join(shape, ", ")));
  const std::string what = fmt::format("({}) {}", fmt::join(shape, ", "), dtype_name(dtype));
  check_write_options(static_cast<int>(shape.size()), what, options, where);
  H5Handle handle = open_for_write(where, options.truncate_file);
  H5Handle object =
      create_open_dataset(handle.get(), where, components, shape, dtype, options, what);
  if (object.close() < 0) fail_hdf5(where, "cannot close the dataset");
  if (handle.close() < 0) fail_hdf5(where, "cannot flush and close the file (disk full?)");
}

void write_hyperslab(const std::string& file, const std::string& dataset, const Box& box,
                     const Tensor& tensor) {
  detail::write_hyperslab(file, dataset, box, tensor, {});
}

void detail::write_hyperslab(const std::string& file, const std::string& dataset, const Box& box,
                             const Tensor& tensor, const Transfer& how, bool write_nothing) {
  Hdf5Call call;
  const std::vector<std::string> components = path_components(file, dataset);
  const Where where{file, join_path(components, components.size())};
  H5Handle handle = open_existing_for_write(where, how.file_access);
  H5Handle object = open_dataset(handle.get(), where, components);
  H5Handle file_space = space_handle(H5Dget_space(object.get()));
  if (!file_space.valid()) fail_hdf5(where, "cannot read the dataspace (corrupted file?)");
  const Shape shape = dataspace_shape(file_space.get(), where);
  const ElementType element = dataset_element_type(object.get(), where);
  if (!element.numeric)
    fail(where, fmt::format("expected a numeric element type to write {} into, found {} (HDF5 "
                            "class {})",
                            dtype_name(tensor.dtype()), element.name, element.class_name));
  const Box written = write_nothing ? Box{Shape(shape.size(), 0), Shape(shape.size(), 0)} : box;
  check_box(written, shape, where);
  if (!write_nothing && tensor.shape() != box.shape())
    fail(where, fmt::format("expected a tensor of shape ({}) for box {}, found {}",
                            fmt::join(box.shape(), ", "), box.str(), tensor.str()));
  write_open_dataset(object.get(), file_space.get(), shape, written, tensor, how, write_nothing,
                     where);
  file_space.close();
  if (object.close() < 0) fail_hdf5(where, "cannot close the dataset");
  if (handle.close() < 0) fail_hdf5(where, "cannot flush and close the file (disk full?)");
}

void write_attributes(const std::string& file, const std::string& dataset,
                      const std::map<std::string, std::string>& attributes) {
  Hdf5Call call;
  const std::vector<std::string> components = path_components(file, dataset);
  const Where where{file, join_path(components, components.size())};
  H5Handle handle = open_existing_for_write(where);
  H5Handle object = open_dataset(handle.get(), where, components);
  for (const auto& [name, value] : attributes) {
    const htri_t exists = H5Aexists(object.get(), name.c_str());
    if (exists < 0) fail_hdf5(where, fmt::format("cannot look for attribute '{}'", name));
    if (exists > 0 && H5Adelete(object.get(), name.c_str()) < 0)
      fail_hdf5(where, fmt::format("cannot replace attribute '{}'", name));
    write_string_attribute(object.get(), name.c_str(), value, where);
  }
  if (object.close() < 0) fail_hdf5(where, "cannot close the dataset");
  if (handle.close() < 0) fail_hdf5(where, "cannot flush and close the file (disk full?)");
}

bool holds_only_dataset(const std::string& file, const std::string& dataset) {
  Hdf5Call call;
  try {
    const std::vector<std::string> components = path_components(file, dataset);
    const Where where{file, join_path(components, components.size())};
    std::error_code error;
    if (!std::filesystem::is_regular_file(file, error) || components.size() != 1) return false;
    H5Handle handle = open_for_read(where);
    H5G_info_t info;
    if (H5Gget_info(handle.get(), &info) < 0 || info.nlinks != 1) return false;
    if (find_object(handle.get(), where, components).kind != ObjectKind::dataset) return false;
    return read_attributes(handle.get(), where).empty();
  } catch (const std::exception&) {
    return false;
  }
}

bool has_dataset(const std::string& file, const std::string& dataset) {
  Hdf5Call call;
  const std::vector<std::string> components = path_components(file, dataset);
  const Where where{file, join_path(components, components.size())};
  std::error_code error;
  if (!std::filesystem::exists(file, error)) return false;
  H5Handle handle = open_for_read(where);
  return find_object(handle.get(), where, components).kind == ObjectKind::dataset;
}

struct DatasetReader::State {
  Where where;
  H5Handle file, dataset, file_space;
  Shape shape;
  ElementType element;
  std::map<DType, H5Handle> memory_types;  ///< per dtype read, made on first use
};

DatasetReader::DatasetReader(const std::string& file, const std::string& dataset)
    : state_(std::make_unique<State>()) {
  Hdf5Call call;
  const std::vector<std::string> components = path_components(file, dataset);
  state_->where = Where{file, join_path(components, components.size())};
  state_->file = open_for_read(state_->where);
  state_->dataset = open_dataset(state_->file.get(), state_->where, components);
  state_->file_space = space_handle(H5Dget_space(state_->dataset.get()));
  if (!state_->file_space.valid())
    fail_hdf5(state_->where, "cannot read the dataspace (corrupted file?)");
  state_->shape = dataspace_shape(state_->file_space.get(), state_->where);
  state_->element = dataset_element_type(state_->dataset.get(), state_->where);
}

DatasetReader::~DatasetReader() {
  if (!state_) return;
  Hdf5Call call;  // the handles close under the lock
  state_.reset();
}

DatasetReader::DatasetReader(DatasetReader&&) noexcept = default;
DatasetReader& DatasetReader::operator=(DatasetReader&& other) noexcept {
  if (this != &other) {
    if (state_) {
      Hdf5Call call;
      state_.reset();
    }
    state_ = std::move(other.state_);
  }
  return *this;
}

const Shape& DatasetReader::shape() const {
  return state_->shape;
}

Tensor DatasetReader::read(const Box& box, std::optional<DType> as) const {
  DType dtype;
  {
    Hdf5Call call;
    dtype = read_dtype(state_->element, as, state_->where);
    check_box(box, state_->shape, state_->where);
  }
  Tensor result = Tensor::empty(box.shape(), dtype);
  read_into(box, dtype, result.raw_data());
  return result;
}

void DatasetReader::read_into(const Box& box, DType as, void* out) const {
  Hdf5Call call;
  State& state = *state_;
  const DType dtype = read_dtype(state.element, as, state.where);
  check_box(box, state.shape, state.where);
  if (box.empty()) return;
  auto type = state.memory_types.find(dtype);
  if (type == state.memory_types.end())
    type =
        state.memory_types.emplace(dtype, hdf5_type(dtype, /*in_memory=*/true, state.where)).first;
  if (move_slab(false, state.dataset.get(), state.file_space.get(), state.shape, box,
                type->second.get(), H5P_DEFAULT, out, state.where) < 0)
    fail_hdf5(state.where, fmt::format("expected to read box {} as {}, found data HDF5 cannot "
                                       "read (truncated or corrupted file?)",
                                       box.str(), dtype_name(dtype)));
}

int64_t file_open_count() {
  return files_opened.load(std::memory_order_relaxed);
}

}  // namespace tessera::io
