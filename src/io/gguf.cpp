// GGUF v2/v3 parser: a bounds-checked cursor walks the header, metadata and
// tensor table; every length is checked against the bytes left before it is
// used, so no input can make the parser read outside the image or allocate
// more than a small multiple of the file size.
#include "io/gguf.h"

#include <fmt/format.h>

#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace loom::gguf {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr size_t kDefaultAlignment = 32;
constexpr size_t kMaxAlignment = size_t{1} << 30;
// Smallest encodings, used to bound counts by the bytes left: a kv is a
// non-empty key (8 + 1), a type (4) and a value (>= 1); a tensor info is a
// non-empty name (8 + 1), n_dims (4), one dim (8), a type (4), an offset (8).
constexpr uint64_t kMinKvBytes = 14;
constexpr uint64_t kMinTensorInfoBytes = 33;
constexpr size_t kMaxQuotedChars = 80;

// Quotes an untrusted string for an error message: escapes control and
// non-ASCII bytes and cuts long strings.
std::string quoted(std::string_view s) {
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < kMaxQuotedChars; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\')
      out += static_cast<char>(c);
    else
      out += fmt::format("\\x{:02x}", c);
  }
  if (s.size() > kMaxQuotedChars) out += fmt::format("...' ({} bytes)", s.size());
  else out += "'";
  return out;
}

bool valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::f64); }

// Bytes the smallest value of type `t` takes in the file.
uint64_t min_value_bytes(ValueType t) {
  switch (t) {
    case ValueType::u8: case ValueType::i8: case ValueType::boolean: return 1;
    case ValueType::u16: case ValueType::i16: return 2;
    case ValueType::u32: case ValueType::i32: case ValueType::f32: return 4;
    case ValueType::u64: case ValueType::i64: case ValueType::f64: return 8;
    case ValueType::string: return 8;   // length only
    case ValueType::array: return 12;   // element type + length
  }
  return 1;
}

// Names of ggml tensor types that loom does not implement, for messages.
const char* ggml_type_name(uint32_t id) {
  switch (id) {
    case 4: return "q4_2 (removed from ggml)";
    case 5: return "q4_3 (removed from ggml)";
    case 16: return "iq2_xxs";
    case 17: return "iq2_xs";
    case 18: return "iq3_xxs";
    case 19: return "iq1_s";
    case 21: return "iq3_s";
    case 22: return "iq2_s";
    case 29: return "iq1_m";
    case 31: return "q4_0_4_4 (removed from ggml)";
    case 32: return "q4_0_4_8 (removed from ggml)";
    case 33:
      return "q4_0_8_8 (removed from ggml)";
    case 36:
    case 37:
    case 38:
      return "iq4_nl repack (removed from ggml)";
  }
  return "unknown";
}

uint32_t byteswap32(uint32_t v) {
  return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}

struct ParsedTensor {
  TensorInfo info;
  uint64_t rel_offset = 0;  // from the start of the data section
};

class Parser {
 public:
  Parser(const uint8_t* data, size_t size, const std::string& file) : p_(data), size_(size), file_(file) {}

  uint32_t version = 0;
  size_t alignment = kDefaultAlignment;
  size_t data_offset = 0;
  std::map<std::string, Value, std::less<>> kv;
  std::vector<ParsedTensor> tensors;

  void run() {
    read_header();
    const uint64_t n_tensors = read<uint64_t>("tensor count");
    const uint64_t n_kv = read<uint64_t>("metadata count");
    if (n_kv > left() / kMinKvBytes)
      invalid("metadata count {} is impossible: the {} bytes left hold at most {} entries", n_kv, left(),
              left() / kMinKvBytes);
    for (uint64_t i = 0; i < n_kv; ++i) read_kv(i);
    ctx_.clear();
    read_alignment();
    if (n_tensors > left() / kMinTensorInfoBytes)
      invalid("tensor count {} is impossible: the {} bytes left hold at most {} tensor infos", n_tensors, left(),
              left() / kMinTensorInfoBytes);
    tensors.reserve(static_cast<size_t>(n_tensors));
    for (uint64_t i = 0; i < n_tensors; ++i) read_tensor_info(i);
    ctx_.clear();
    // pos_ <= size_ and alignment <= 2^30, so this cannot overflow.
    data_offset = (pos_ + alignment - 1) / alignment * alignment;
    for (auto& t : tensors) place_tensor(t);
  }

 private:
  template <typename... Args>
  [[noreturn]] void raise(ErrorKind kind, fmt::format_string<Args...> f, Args&&... args) const {
    const std::string msg = fmt::format(f, std::forward<Args>(args)...);
    if (ctx_.empty()) fail(kind, "{}: {}", file_, msg);
    fail(kind, "{}: {}: {}", file_, ctx_, msg);
  }
  template <typename... Args>
  [[noreturn]] void invalid(fmt::format_string<Args...> f, Args&&... args) const {
    raise(ErrorKind::invalid_input, f, std::forward<Args>(args)...);
  }

  size_t left() const { return size_ - pos_; }

  template <typename T>
  T read(const char* what) {
    if (left() < sizeof(T))
      invalid("truncated: {} needs {} bytes at offset {} but the file has {} bytes", what, sizeof(T), pos_, size_);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string read_string(const char* what) {
    const uint64_t len = read<uint64_t>(what);
    if (len > left())
      invalid("{} length {} exceeds the {} bytes left in the file (offset {})", what, len, left(), pos_);
    std::string s(reinterpret_cast<const char*>(p_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return s;
  }

  void read_header() {
    if (size_ < 8) invalid("too small to be a GGUF file ({} bytes)", size_);
    const uint32_t magic = read<uint32_t>("magic");
    if (magic != kMagic)
      invalid("not a GGUF file: magic is {} instead of 'GGUF'",
              quoted(std::string_view(reinterpret_cast<const char*>(p_), 4)));
    version = read<uint32_t>("version");
    if (version != 1 && version != 2 && version != 3) {
      const uint32_t swapped = byteswap32(version);
      if (swapped >= 1 && swapped <= 3)
        raise(ErrorKind::unsupported, "big-endian GGUF files are not supported");
      raise(ErrorKind::unsupported, "GGUF version {} is not supported (loom reads versions 2 and 3)", version);
    }
    if (version == 1)
      raise(ErrorKind::unsupported,
            "GGUF version 1 is not supported (loom reads versions 2 and 3; re-convert the model)");
  }

  void read_kv(uint64_t index) {
    ctx_ = fmt::format("metadata entry #{}", index);
    std::string key = read_string("key");
    if (key.empty()) invalid("empty key");
    ctx_ = fmt::format("key {}", quoted(key));
    if (kv.count(key) != 0) invalid("duplicate key");
    const uint32_t type = read<uint32_t>("value type");
    if (!valid_value_type(type)) invalid("unknown value type {}", type);
    Value v = read_value(static_cast<ValueType>(type), 0);
    kv.emplace(std::move(key), std::move(v));
  }

  Value read_value(ValueType type, int depth) {
    Value out;
    out.type = type;
    switch (type) {
      case ValueType::u8: out.v = uint64_t{read<uint8_t>("u8 value")}; break;
      case ValueType::i8: out.v = int64_t{read<int8_t>("i8 value")}; break;
      case ValueType::u16: out.v = uint64_t{read<uint16_t>("u16 value")}; break;
      case ValueType::i16: out.v = int64_t{read<int16_t>("i16 value")}; break;
      case ValueType::u32: out.v = uint64_t{read<uint32_t>("u32 value")}; break;
      case ValueType::i32: out.v = int64_t{read<int32_t>("i32 value")}; break;
      case ValueType::u64: out.v = read<uint64_t>("u64 value"); break;
      case ValueType::i64: out.v = read<int64_t>("i64 value"); break;
      case ValueType::f32: out.v = double{read<float>("f32 value")}; break;
      case ValueType::f64: out.v = read<double>("f64 value"); break;
      case ValueType::boolean: {
        const uint8_t b = read<uint8_t>("bool value");
        if (b > 1) invalid("bool value {} is neither 0 nor 1", b);
        out.v = b == 1;
        break;
      }
      case ValueType::string: out.v = read_string("string"); break;
      case ValueType::array: out.v = read_array(depth); break;
    }
    return out;
  }

  Array read_array(int depth) {
    if (depth >= kMaxArrayDepth) invalid("arrays nested more than {} deep", kMaxArrayDepth);
    const uint32_t et = read<uint32_t>("array element type");
    if (!valid_value_type(et)) invalid("unknown array element type {}", et);
    Array arr;
    arr.element_type = static_cast<ValueType>(et);
    const uint64_t n = read<uint64_t>("array length");
    const uint64_t min_bytes = min_value_bytes(arr.element_type);
    // Division, not n * min_bytes: the product could overflow.
    if (n > left() / min_bytes)
      invalid("array of {} {} elements needs at least {} bytes per element but only {} bytes are left", n,
              value_type_name(arr.element_type), min_bytes, left());
    if (n > kMaxArrayElements - array_elements_)
      invalid("metadata arrays hold more than {} elements in total", kMaxArrayElements);
    array_elements_ += n;
    arr.items.reserve(static_cast<size_t>(n));
    for (uint64_t i = 0; i < n; ++i) arr.items.push_back(read_value(arr.element_type, depth + 1));
    return arr;
  }

  void read_alignment() {
    const auto it = kv.find("general.alignment");
    if (it == kv.end()) return;
    ctx_ = "key 'general.alignment'";
    const Value& v = it->second;
    if (v.type != ValueType::u8 && v.type != ValueType::u16 && v.type != ValueType::u32 &&
        v.type != ValueType::u64)
      invalid("alignment must be an unsigned integer, not {}", value_type_name(v.type));
    const uint64_t a = std::get<uint64_t>(v.v);
    if (a == 0 || (a & (a - 1)) != 0 || a > kMaxAlignment)
      invalid("alignment {} is not a power of two between 1 and {}", a, kMaxAlignment);
    alignment = static_cast<size_t>(a);
    ctx_.clear();
  }

  void read_tensor_info(uint64_t index) {
    ctx_ = fmt::format("tensor #{}", index);
    ParsedTensor t;
    TensorInfo& ti = t.info;
    ti.name = read_string("tensor name");
    if (ti.name.empty()) invalid("empty tensor name");
    ctx_ = fmt::format("tensor {}", quoted(ti.name));
    const uint32_t n_dims = read<uint32_t>("n_dims");
    if (n_dims < 1 || n_dims > static_cast<uint32_t>(Tensor::kMaxDims))
      invalid("n_dims {} is outside 1..{}", n_dims, Tensor::kMaxDims);
    uint64_t ne[Tensor::kMaxDims] = {};
    for (uint32_t d = 0; d < n_dims; ++d) ne[d] = read<uint64_t>("dimension");
    const uint32_t type_id = read<uint32_t>("tensor type");
    t.rel_offset = read<uint64_t>("data offset");

    // Validate only after the whole record is read so truncation is reported first.
    if (!tensor_index_.emplace(ti.name, index).second) invalid("duplicate tensor name");
    const auto traits = dtype_traits_of_id(type_id);
    if (!traits) {
      raise(ErrorKind::unsupported, "tensor type {} ({}) is not supported", type_id, ggml_type_name(type_id));
    }
    ti.dtype = traits->type;
    ti.ndim = static_cast<int>(n_dims);
    int64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      if (ne[d] == 0) invalid("dimension {} is 0", d);
      if (ne[d] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        invalid("dimension {} = {} is too large", d, ne[d]);
      if (__builtin_mul_overflow(numel, static_cast<int64_t>(ne[d]), &numel))
        invalid("element count overflows 64 bits (dims {})", dims_string(ne, n_dims));
      ti.shape[n_dims - 1 - d] = static_cast<int64_t>(ne[d]);  // outermost first
    }
    const auto row_len = static_cast<int64_t>(ne[0]);
    if (row_len % traits->block_size != 0)
      invalid("row length {} is not a multiple of the {} block size {}", row_len, traits->name,
              traits->block_size);
    const auto blocks_per_row = static_cast<uint64_t>(row_len / traits->block_size);
    const auto rows = static_cast<uint64_t>(numel / row_len);
    uint64_t row_bytes = 0, nbytes = 0;
    if (__builtin_mul_overflow(blocks_per_row, static_cast<uint64_t>(traits->block_bytes), &row_bytes) ||
        __builtin_mul_overflow(row_bytes, rows, &nbytes) || nbytes > std::numeric_limits<size_t>::max())
      invalid("byte size overflows (dims {}, type {})", dims_string(ne, n_dims), traits->name);
    ti.nbytes = static_cast<size_t>(nbytes);
    if (t.rel_offset % alignment != 0)
      invalid("data offset {} is not a multiple of the alignment {}", t.rel_offset, alignment);
    tensors.push_back(std::move(t));
  }

  void place_tensor(ParsedTensor& t) {
    ctx_ = fmt::format("tensor {}", quoted(t.info.name));
    const uint64_t avail = data_offset <= size_ ? size_ - data_offset : 0;
    if (data_offset > size_ || t.rel_offset > avail || t.info.nbytes > avail - t.rel_offset)
      invalid("data at offset {} + {} ({} bytes) extends past the end of the file ({} bytes)", data_offset,
              t.rel_offset, t.info.nbytes, size_);
    t.info.offset = data_offset + t.rel_offset;
    t.info.data = p_ + t.info.offset;
  }

  static std::string dims_string(const uint64_t* ne, uint32_t n) {
    std::string s = "ne=[";
    for (uint32_t d = 0; d < n; ++d) s += fmt::format("{}{}", d ? ", " : "", ne[d]);
    return s + "]";
  }

  const uint8_t* p_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& file_;
  std::string ctx_;  // "key 'x'" / "tensor 'y'" prefix for messages
  uint64_t array_elements_ = 0;
  std::map<std::string, uint64_t, std::less<>> tensor_index_;
};

[[noreturn]] void wrong_type(const File& f, std::string_view key, const char* expected, const Value& v) {
  if (v.type == ValueType::array)
    fail(ErrorKind::invalid_input, "{}: key '{}': expected {}, got array of {}", f.path(), key, expected,
         value_type_name(std::get<Array>(v.v).element_type));
  fail(ErrorKind::invalid_input, "{}: key '{}': expected {}, got {}", f.path(), key, expected,
       value_type_name(v.type));
}

const Value& require(const File& f, std::string_view key) {
  const Value* v = f.find(key);
  if (v == nullptr) fail(ErrorKind::invalid_input, "{}: key '{}': missing", f.path(), key);
  return *v;
}

bool is_unsigned(ValueType t) {
  return t == ValueType::u8 || t == ValueType::u16 || t == ValueType::u32 || t == ValueType::u64;
}
bool is_signed(ValueType t) {
  return t == ValueType::i8 || t == ValueType::i16 || t == ValueType::i32 || t == ValueType::i64;
}
bool is_float(ValueType t) { return t == ValueType::f32 || t == ValueType::f64; }

const Array& require_array(const File& f, std::string_view key, const char* expected) {
  const Value& v = require(f, key);
  if (v.type != ValueType::array) wrong_type(f, key, expected, v);
  return std::get<Array>(v.v);
}

}  // namespace

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::u8: return "u8";
    case ValueType::i8: return "i8";
    case ValueType::u16: return "u16";
    case ValueType::i16: return "i16";
    case ValueType::u32: return "u32";
    case ValueType::i32: return "i32";
    case ValueType::f32: return "f32";
    case ValueType::boolean: return "bool";
    case ValueType::string: return "string";
    case ValueType::array: return "array";
    case ValueType::u64: return "u64";
    case ValueType::i64: return "i64";
    case ValueType::f64: return "f64";
  }
  return "unknown";
}

Tensor TensorInfo::view() const {
  Tensor t;
  t.data = const_cast<uint8_t*>(data);  // weights are read-only; Tensor has no const flavour
  t.dtype = dtype;
  t.ndim = ndim;
  t.shape = shape;
  return t;
}

std::unique_ptr<File> File::open(const std::string& path) {
  auto mapping = std::make_unique<MappedFile>(path);
  std::unique_ptr<File> f(new File());
  f->data_ = mapping->data();
  f->size_ = mapping->size();
  f->name_ = path;
  f->mapping_ = std::move(mapping);
  f->parse_all();
  return f;
}

std::unique_ptr<File> File::parse(const uint8_t* data, size_t size, const std::string& name) {
  std::unique_ptr<File> f(new File());
  f->data_ = data;
  f->size_ = data == nullptr ? 0 : size;
  f->name_ = name;
  f->parse_all();
  return f;
}

void File::parse_all() {
  Parser p(data_, size_, name_);
  p.run();
  version_ = p.version;
  alignment_ = p.alignment;
  data_offset_ = p.data_offset;
  kv_ = std::move(p.kv);
  tensors_.reserve(p.tensors.size());
  for (auto& t : p.tensors) {
    tensor_index_.emplace(t.info.name, tensors_.size());
    tensors_.push_back(std::move(t.info));
  }
}

const Value* File::find(std::string_view key) const {
  const auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::string File::get_string(std::string_view key) const {
  const Value& v = require(*this, key);
  if (v.type != ValueType::string) wrong_type(*this, key, "string", v);
  return std::get<std::string>(v.v);
}

uint64_t File::get_uint(std::string_view key) const {
  const Value& v = require(*this, key);
  if (is_unsigned(v.type)) return std::get<uint64_t>(v.v);
  if (is_signed(v.type)) {
    const int64_t i = std::get<int64_t>(v.v);
    if (i < 0) fail(ErrorKind::invalid_input, "{}: key '{}': expected a non-negative integer, got {}", name_, key, i);
    return static_cast<uint64_t>(i);
  }
  wrong_type(*this, key, "an unsigned integer", v);
}

int64_t File::get_int(std::string_view key) const {
  const Value& v = require(*this, key);
  if (is_signed(v.type)) return std::get<int64_t>(v.v);
  if (is_unsigned(v.type)) {
    const uint64_t u = std::get<uint64_t>(v.v);
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(ErrorKind::invalid_input, "{}: key '{}': value {} does not fit in a signed 64-bit integer", name_, key, u);
    return static_cast<int64_t>(u);
  }
  wrong_type(*this, key, "an integer", v);
}

double File::get_float(std::string_view key) const {
  const Value& v = require(*this, key);
  if (is_float(v.type)) return std::get<double>(v.v);
  if (is_unsigned(v.type)) return static_cast<double>(std::get<uint64_t>(v.v));
  if (is_signed(v.type)) return static_cast<double>(std::get<int64_t>(v.v));
  wrong_type(*this, key, "a number", v);
}

bool File::get_bool(std::string_view key) const {
  const Value& v = require(*this, key);
  if (v.type != ValueType::boolean) wrong_type(*this, key, "bool", v);
  return std::get<bool>(v.v);
}

std::optional<std::string> File::opt_string(std::string_view key) const {
  if (find(key) == nullptr) return std::nullopt;
  return get_string(key);
}
std::optional<uint64_t> File::opt_uint(std::string_view key) const {
  if (find(key) == nullptr) return std::nullopt;
  return get_uint(key);
}
std::optional<double> File::opt_float(std::string_view key) const {
  if (find(key) == nullptr) return std::nullopt;
  return get_float(key);
}
std::optional<bool> File::opt_bool(std::string_view key) const {
  if (find(key) == nullptr) return std::nullopt;
  return get_bool(key);
}

std::vector<std::string> File::get_string_array(std::string_view key) const {
  const Array& a = require_array(*this, key, "array of string");
  if (a.element_type != ValueType::string) wrong_type(*this, key, "array of string", require(*this, key));
  std::vector<std::string> out;
  out.reserve(a.items.size());
  for (const Value& e : a.items) out.push_back(std::get<std::string>(e.v));
  return out;
}

std::vector<float> File::get_f32_array(std::string_view key) const {
  const Array& a = require_array(*this, key, "array of numbers");
  std::vector<float> out;
  out.reserve(a.items.size());
  if (is_float(a.element_type)) {
    for (const Value& e : a.items) out.push_back(static_cast<float>(std::get<double>(e.v)));
  } else if (is_unsigned(a.element_type)) {
    for (const Value& e : a.items) out.push_back(static_cast<float>(std::get<uint64_t>(e.v)));
  } else if (is_signed(a.element_type)) {
    for (const Value& e : a.items) out.push_back(static_cast<float>(std::get<int64_t>(e.v)));
  } else {
    wrong_type(*this, key, "array of numbers", require(*this, key));
  }
  return out;
}

std::vector<int32_t> File::get_i32_array(std::string_view key) const {
  const Array& a = require_array(*this, key, "array of integers");
  const bool u = is_unsigned(a.element_type);
  if (!u && !is_signed(a.element_type)) wrong_type(*this, key, "array of integers", require(*this, key));
  std::vector<int32_t> out;
  out.reserve(a.items.size());
  for (size_t i = 0; i < a.items.size(); ++i) {
    const Value& e = a.items[i];
    const bool fits = u ? std::get<uint64_t>(e.v) <= static_cast<uint64_t>(std::numeric_limits<int32_t>::max())
                        : std::get<int64_t>(e.v) >= std::numeric_limits<int32_t>::min() &&
                              std::get<int64_t>(e.v) <= std::numeric_limits<int32_t>::max();
    if (!fits) {
      if (u)
        fail(ErrorKind::invalid_input, "{}: key '{}': element {} = {} does not fit in int32", name_, key, i,
             std::get<uint64_t>(e.v));
      fail(ErrorKind::invalid_input, "{}: key '{}': element {} = {} does not fit in int32", name_, key, i,
           std::get<int64_t>(e.v));
    }
    out.push_back(u ? static_cast<int32_t>(std::get<uint64_t>(e.v)) : static_cast<int32_t>(std::get<int64_t>(e.v)));
  }
  return out;
}

bool is_gguf_file(const std::string& path) {
  // stat and stdio, not <filesystem> / <fstream>: their std::quoted would be found for this file's own
  // quoted() by argument-dependent lookup.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  char magic[4] = {};
  return f && std::fread(magic, 1, 4, f.get()) == 4 && std::memcmp(magic, "GGUF", 4) == 0;
}

}  // namespace loom::gguf
