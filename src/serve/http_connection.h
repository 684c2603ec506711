// Connection handling for `loom serve` under cpp-httplib 0.11 (Debian). httplib gives each connection a
// thread from a fixed pool for its whole life and reads a request with only a per-recv timeout, so a few
// dozen clients that send one header line every few seconds hold every thread and starve everyone else;
// and a handler cannot see that its client went away. ConnectionServer replaces httplib's per-connection
// loop (process_and_close_socket, the hook its SSL server uses) with one that bounds the time a request
// may take to arrive, caps open connections, runs each connection on its own thread (an elastic pool),
// and lets the handler on that thread ask whether its client is still there.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace loom {

struct ConnectionLimits {
  // The request line and headers must arrive within this, counted from the connection's accept (first
  // request) or from the first byte of the request (later keep-alive requests). Past it: 408, closed.
  std::chrono::milliseconds header_timeout{10'000};
  // The body must arrive within this after the headers. Past it: 408, closed.
  std::chrono::milliseconds body_timeout{60'000};
  size_t max_header_bytes = 64u << 10;  // request line + headers; more: 431, closed
  // Open connections (each has a thread); one more gets 503 "too_many_connections" and is closed.
  int64_t max_connections = 512;
  // Idle connection threads kept for reuse; more start on demand (up to max_connections plus a few to
  // answer the 503s) and stop after a while without work.
  int64_t keep_threads = 64;
};

// An httplib task queue that starts a thread whenever no idle one is waiting, up to `max_threads` (then
// tasks queue), and lets threads beyond `keep_threads` stop after `idle_exit` without work.
class ConnectionPool final : public httplib::TaskQueue {
 public:
  ConnectionPool(size_t keep_threads, size_t max_threads,
                 std::chrono::milliseconds idle_exit = std::chrono::seconds(30));
  ~ConnectionPool() override;
  void enqueue(std::function<void()> fn) override;
  void shutdown() override;  // runs what is queued, then joins every thread
  size_t threads() const;

 private:
  void work();
  void reap_locked();  // joins threads that stopped

  const size_t keep_, max_;
  const std::chrono::milliseconds idle_exit_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::unordered_map<std::thread::id, std::thread> threads_;
  std::vector<std::thread::id> stopped_;
  size_t idle_ = 0;
  bool shutdown_ = false;
};

class ClientConnection;

class ConnectionServer : public httplib::Server {
 public:
  explicit ConnectionServer(ConnectionLimits limits);
  ~ConnectionServer() override;

  // httplib listens with a backlog of 5, so a burst of clients connecting at once gets SYNs dropped and
  // waits out a 1 s retransmit. Linux lets listen() be called again on a listening socket to raise it.
  void raise_backlog(int backlog);

  // For handlers (they run on their connection's thread): whether the client of the request being handled
  // on this thread closed or reset its connection. False on a thread without a connection.
  bool client_gone() const;
  // Whether the request on this thread failed because it did not arrive within the header or body timeout.
  bool request_timed_out() const;
  // Whether its request line and headers ran past max_header_bytes.
  bool request_headers_too_large() const;
  // The connection of the request on this thread closes once its response is written (a handler that
  // answered without reading the body: its bytes must not be read as the next request).
  void close_after_response() const;

  int64_t open_connections() const { return open_.load(); }
  const ConnectionLimits& limits() const { return limits_; }

  // Called (on the connection's thread) for each connection refused over max_connections.
  std::function<void()> on_refused;

 private:
  bool process_and_close_socket(socket_t sock) override;
  void refuse(socket_t sock);
  const ClientConnection* current() const;

  ConnectionLimits limits_;
  std::atomic<int64_t> open_{0};
  mutable std::mutex mu_;
  std::unordered_map<std::thread::id, const ClientConnection*> by_thread_;
};

}  // namespace loom
