// ConnectionServer: deadlines, a connection cap and disconnect detection under httplib (http_connection.h).
#include "serve/http_connection.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "serve/openai_protocol.h"

namespace loom {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

// Waits for `events` on `fd` for at most `timeout`; the poll result (revents), 0 on timeout, -1 on error.
int wait_fd(int fd, short events, milliseconds timeout) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int r = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, timeout.count())));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    return r == 0 ? 0 : p.revents;
  }
}

// Whether the peer closed its side or reset the connection (unread request bytes do not count).
bool peer_closed(int fd) {
  const int ev = wait_fd(fd, POLLIN | POLLRDHUP, milliseconds(0));
  if (ev < 0) return true;
  if (ev & (POLLERR | POLLHUP | POLLNVAL)) return true;
  if (!(ev & (POLLIN | POLLRDHUP))) return false;
  char c;
  const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return false;  // data (a pipelined request); a close behind it is seen once it is read
  return n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

// After an answer the request's bytes were not all read for: ends the sending side, then reads and
// discards what the client still sends until it closes, goes quiet for `quiet`, `total` passes, or `stop`
// says so. Closing with bytes unread would send a reset that can destroy the answer in flight.
template <typename Stop>
void half_close_and_drain(int fd, milliseconds total, milliseconds quiet, Stop stop) {
  ::shutdown(fd, SHUT_WR);
  const auto until = Clock::now() + total;
  char sink[16384];
  while (!stop()) {
    const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now());
    if (left.count() <= 0 || wait_fd(fd, POLLIN, std::min(left, quiet)) <= 0) break;
    if (::recv(fd, sink, sizeof sink, MSG_DONTWAIT) <= 0) break;
  }
}

void address_of(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  const int r = peer ? ::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len)
                     : ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  if (r != 0) return;
  char buf[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf);
    port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof buf);
    port = ntohs(a->sin6_port);
  }
  ip = buf;
}

constexpr milliseconds kSlice{100};  // how often blocked reads look at whether the server is stopping

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// ConnectionPool

ConnectionPool::ConnectionPool(size_t keep_threads, size_t max_threads, milliseconds idle_exit)
    : keep_(keep_threads), max_(std::max<size_t>(1, max_threads)), idle_exit_(idle_exit) {}

ConnectionPool::~ConnectionPool() { shutdown(); }

void ConnectionPool::enqueue(std::function<void()> fn) {
  std::lock_guard lock(mu_);
  reap_locked();
  jobs_.push_back(std::move(fn));
  if (idle_ < jobs_.size() && threads_.size() < max_) {
    std::thread t([this] { work(); });
    const auto id = t.get_id();
    threads_.emplace(id, std::move(t));
  }
  cv_.notify_one();
}

void ConnectionPool::shutdown() {
  std::unordered_map<std::thread::id, std::thread> threads;
  {
    std::lock_guard lock(mu_);
    shutdown_ = true;
    if (!jobs_.empty() && threads_.empty()) {  // queued connections still get closed by a worker
      std::thread t([this] { work(); });
      const auto id = t.get_id();
      threads_.emplace(id, std::move(t));
    }
    threads.swap(threads_);
    stopped_.clear();
  }
  cv_.notify_all();
  for (auto& [id, t] : threads) t.join();
}

size_t ConnectionPool::threads() const {
  std::lock_guard lock(mu_);
  return threads_.size() - stopped_.size();
}

void ConnectionPool::reap_locked() {
  for (const auto id : stopped_) {
    const auto it = threads_.find(id);
    if (it == threads_.end()) continue;
    it->second.join();  // it has left work(): nothing of ours is touched any more
    threads_.erase(it);
  }
  stopped_.clear();
}

void ConnectionPool::work() {
  std::unique_lock lock(mu_);
  for (;;) {
    ++idle_;
    const bool woke = cv_.wait_for(lock, idle_exit_, [&] { return shutdown_ || !jobs_.empty(); });
    --idle_;
    if (jobs_.empty()) {
      if (shutdown_) return;
      if (!woke && threads_.size() - stopped_.size() > keep_) {
        stopped_.push_back(std::this_thread::get_id());
        return;
      }
      continue;
    }
    auto fn = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    try {
      fn();
    } catch (...) {  // a connection's failure must not end the process (process_and_close_socket closes it)
    }
    lock.lock();
  }
}

// ---------------------------------------------------------------------------------------------------------------
// ClientConnection: an httplib::Stream over one accepted socket with a read buffer that lives as long as the
// connection (pipelined bytes are kept) and read deadlines per request phase.

class ClientConnection final : public httplib::Stream {
 public:
  ClientConnection(int fd, const ConnectionLimits& limits, milliseconds write_timeout,
                   const std::atomic<socket_t>& listener)
      : fd_(fd), limits_(limits), write_timeout_(write_timeout), listener_(listener) {}

  // Waits up to `timeout` for the first byte of the next request. False: nothing came, the client closed,
  // or the server is stopping.
  bool wait_for_request(milliseconds timeout) {
    if (pos_ < len_) return true;
    const auto until = Clock::now() + timeout;
    while (!stopping()) {
      const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now());
      if (left.count() <= 0) return false;
      const int ev = wait_fd(fd_, POLLIN, std::min(left, kSlice));
      if (ev < 0) return false;
      if (ev != 0) return true;
    }
    return false;
  }

  // A request starts: its headers are due `limits.header_timeout` after `start`.
  void begin_request(Clock::time_point start) {
    in_headers_ = true;
    timed_out_ = false;
    failed_ = false;
    header_bytes_ = 0;
    tail_ = 0;
    wrote_ = false;
    deadline_ = start + limits_.header_timeout;
  }
  bool wrote() const { return wrote_; }  // some of a response to this request was sent

  // After an answer given without reading the body: ends the sending side, then reads and discards what
  // the client still sends (its body) until it closes, goes quiet for a second, or the body timeout
  // passes. A client that sends its whole body before reading (Python's http.client) would otherwise get
  // a reset instead of the answer.
  void drain_after_answer() {
    half_close_and_drain(fd_, limits_.body_timeout, milliseconds(1000), [this] { return stopping(); });
  }

  bool timed_out() const { return timed_out_; }
  bool failed() const { return failed_; }
  // The request line and headers ran past limits.max_header_bytes (the connection is answered 431).
  bool headers_too_large() const { return headers_too_large_; }
  // A handler answered without reading the body (a bad Content-Length): the connection closes after the
  // response, so the body's bytes are never read as a next request.
  void close_after_response() const { closing_ = true; }
  bool closing() const { return closing_; }
  bool client_gone() const { return peer_closed(fd_); }

  bool is_readable() const override {
    if (pos_ < len_) return true;
    const auto left = std::chrono::duration_cast<milliseconds>(deadline_ - Clock::now());
    return left.count() > 0 && wait_fd(fd_, POLLIN, std::min(left, milliseconds(5000))) > 0;
  }

  bool is_writable() const override {
    const int ev = wait_fd(fd_, POLLOUT, write_timeout_);
    return ev > 0 && !(ev & (POLLERR | POLLHUP | POLLNVAL)) && !peer_closed(fd_);
  }

  ssize_t read(char* ptr, size_t size) override {
    if (failed_ || size == 0) return failed_ ? -1 : 0;
    if (pos_ == len_ && !fill()) return -1;
    const size_t n = std::min(size, len_ - pos_);
    std::memcpy(ptr, buf_ + pos_, n);
    pos_ += n;
    if (in_headers_) scan_headers(ptr, n);
    return failed_ ? -1 : static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    const auto until = Clock::now() + write_timeout_;
    for (;;) {
      const ssize_t n = ::send(fd_, ptr, size, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0) {
        wrote_ = wrote_ || n > 0;
        return n;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
      const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now());
      if (left.count() <= 0) return -1;  // the client stopped reading
      const int ev = wait_fd(fd_, POLLOUT, left);
      if (ev <= 0 || (ev & (POLLERR | POLLHUP | POLLNVAL))) return -1;
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address_of(fd_, true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address_of(fd_, false, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  bool stopping() const { return listener_.load() == INVALID_SOCKET; }

  // Reads what the socket has into the buffer before the phase's deadline.
  bool fill() {
    while (!stopping()) {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline_ - Clock::now());
      if (left.count() <= 0) {
        timed_out_ = failed_ = true;
        return false;
      }
      const int ev = wait_fd(fd_, POLLIN, std::min(left, kSlice));
      if (ev < 0) break;
      if (ev == 0) continue;
      const ssize_t n = ::recv(fd_, buf_, sizeof buf_, MSG_DONTWAIT);
      if (n > 0) {
        pos_ = 0;
        len_ = static_cast<size_t>(n);
        return true;
      }
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      break;  // closed or reset
    }
    failed_ = true;
    return false;
  }

  // Finds the blank line that ends the headers; from then on the body deadline applies.
  void scan_headers(const char* p, size_t n) {
    static constexpr char kEnd[] = "\r\n\r\n";
    for (size_t i = 0; i < n && in_headers_; ++i) {
      tail_ = p[i] == kEnd[tail_] ? tail_ + 1 : (p[i] == '\r' ? 1 : 0);
      if (tail_ == 4) {
        in_headers_ = false;
        deadline_ = Clock::now() + limits_.body_timeout;
      }
    }
    header_bytes_ += n;
    if (in_headers_ && header_bytes_ > limits_.max_header_bytes) failed_ = headers_too_large_ = true;
  }

  const int fd_;
  const ConnectionLimits& limits_;
  const milliseconds write_timeout_;
  const std::atomic<socket_t>& listener_;
  char buf_[4096];
  size_t pos_ = 0, len_ = 0;
  Clock::time_point deadline_ = Clock::now();
  bool in_headers_ = true, timed_out_ = false, failed_ = false, headers_too_large_ = false, wrote_ = false;
  mutable bool closing_ = false;
  size_t header_bytes_ = 0;
  int tail_ = 0;  // how much of "\r\n\r\n" the last bytes matched
};

// ---------------------------------------------------------------------------------------------------------------
// ConnectionServer

ConnectionServer::ConnectionServer(ConnectionLimits limits) : limits_(limits) {
  if (limits_.max_connections < 1) fail(ErrorKind::invalid_input, "--max-connections must be >= 1");
  if (limits_.header_timeout.count() <= 0 || limits_.body_timeout.count() <= 0)
    fail(ErrorKind::invalid_input, "--http-header-timeout and --http-body-timeout must be positive");
  // A few threads beyond the cap answer the connections it refuses.
  const auto max_threads = static_cast<size_t>(limits_.max_connections) + 16;
  const auto keep = static_cast<size_t>(std::clamp<int64_t>(limits_.keep_threads, 1, limits_.max_connections));
  new_task_queue = [keep, max_threads] { return new ConnectionPool(keep, max_threads); };
}

ConnectionServer::~ConnectionServer() = default;

void ConnectionServer::raise_backlog(int backlog) {
  const socket_t fd = svr_sock_;
  if (fd != INVALID_SOCKET) ::listen(fd, backlog);
}

const ClientConnection* ConnectionServer::current() const {
  std::lock_guard lock(mu_);
  const auto it = by_thread_.find(std::this_thread::get_id());
  return it == by_thread_.end() ? nullptr : it->second;
}

bool ConnectionServer::client_gone() const {
  const ClientConnection* c = current();
  return c && c->client_gone();
}

bool ConnectionServer::request_timed_out() const {
  const ClientConnection* c = current();
  return c && c->timed_out();
}

bool ConnectionServer::request_headers_too_large() const {
  const ClientConnection* c = current();
  return c && c->headers_too_large();
}

void ConnectionServer::close_after_response() const {
  if (const ClientConnection* c = current()) c->close_after_response();
}

namespace {

// Sends an error object with `status_line` ("503 Service Unavailable") and `extra` headers on a connection
// httplib will not answer, then half-closes it and drains what the client still sends for a moment.
void answer_and_close(socket_t sock, const char* status_line, const ApiError& error, const char* extra) {
  const std::string body = dump_json(error_json(error));
  const std::string msg = fmt::format(
      "HTTP/1.1 {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}Connection: close\r\n\r\n{}",
      status_line, body.size(), extra, body);
  (void)::send(sock, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  // Bounded, so refusals stay cheap.
  half_close_and_drain(sock, milliseconds(200), milliseconds(200), [] { return false; });
}

}  // namespace

void ConnectionServer::refuse(socket_t sock) {
  answer_and_close(
      sock, "503 Service Unavailable",
      ApiError(503, "server_error", "too_many_connections", "",
               fmt::format("The server already has {} open connections (--max-connections); retry "
                           "later.",
                           limits_.max_connections)),
      "Retry-After: 1\r\n");
  if (on_refused) on_refused();
}

bool ConnectionServer::process_and_close_socket(socket_t sock) {
  const auto accepted = Clock::now();
  const int64_t open = ++open_;
  bool ret = false;
  if (open > limits_.max_connections) {
    refuse(sock);
  } else {
    int one = 1;
    ::setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ClientConnection conn(sock, limits_, milliseconds(write_timeout_sec_ * 1000 + write_timeout_usec_ / 1000),
                          svr_sock_);
    {
      std::lock_guard lock(mu_);
      by_thread_[std::this_thread::get_id()] = &conn;
    }
    size_t count = std::max<size_t>(1, keep_alive_max_count_);
    bool first = true;
    // The first request's header time counts from the accept, so a connection that sends nothing is
    // closed after the header timeout; later ones may idle for the keep-alive timeout first.
    while (conn.wait_for_request(first ? limits_.header_timeout - std::chrono::duration_cast<milliseconds>(
                                                                      Clock::now() - accepted)
                                       : milliseconds(keep_alive_timeout_sec_ * 1000))) {
      conn.begin_request(first ? accepted : Clock::now());
      first = false;
      bool closed = false;
      try {
        ret = process_request(conn, count == 1, closed, nullptr);
      } catch (...) {  // e.g. from a response's content provider, which runs outside httplib's handler try
        ret = false;
      }
      if (!ret || closed || conn.failed() || conn.closing() || --count == 0) break;
    }
    {
      std::lock_guard lock(mu_);
      by_thread_.erase(std::this_thread::get_id());
    }
    if (conn.closing()) conn.drain_after_answer();
    if (conn.headers_too_large() &&
        !conn.wrote())  // httplib answers nothing when it cannot read the request line
      answer_and_close(sock, "431 Request Header Fields Too Large",
                       ApiError(431, "invalid_request_error", "request_too_large", "",
                                fmt::format("The request line and headers are longer than {} bytes.",
                                            limits_.max_header_bytes)),
                       "");
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  --open_;
  return ret;
}

}  // namespace loom
